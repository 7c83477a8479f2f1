"""envd's directory watching on the edge's watch_dir (the agent's inotify).

WatchDir is a server stream of the edge's events. CreateWatcher / GetWatcherEvents /
RemoveWatcher (what the sync SDK polls) keep a watch open here in the apiserver: a background
task collects its events (at most EVENTS_KEPT, oldest dropped) until the watcher is removed,
its sandbox ends, or nobody asked for its events for IDLE_DROP_S (its client is gone: an open
watch keeps the sandbox busy). Watcher ids are local to the
apiserver that made them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from e2b.envd.filesystem import filesystem_pb as pb

from dsec.apiserver.context import ApiContext
from dsec.apiserver.e2b.control import check_exec
from dsec.apiserver.e2b.envd_common import Target, with_keepalive
from dsec.apiserver.e2b.errors import connect_error
from dsec.types import DsecError, ExecRequest, FsEvent

log = logging.getLogger("dsec.apiserver.e2b")

EVENT_TYPES = {"create": pb.EventType.CREATE, "write": pb.EventType.WRITE, "remove": pb.EventType.REMOVE,
               "rename": pb.EventType.RENAME, "chmod": pb.EventType.CHMOD}
EVENTS_KEPT = 10_000          # per watcher, between two GetWatcherEvents
WATCHERS_PER_SANDBOX = 16     # the agent's own bound (MAX_WATCHES)
IDLE_DROP_S = 600.0           # a watcher nobody polled this long is dropped (a client that died)
IDLE_CHECK_S = 30.0
ENDED_KEEP_S = 60.0           # an ended watcher still answers (its error) this long


def fs_event(ev: FsEvent) -> pb.FilesystemEvent | None:
    """envd's event for a change; None for what envd has no name for (start, overflow)."""
    kind = EVENT_TYPES.get(ev.type)
    return None if kind is None else pb.FilesystemEvent(name=ev.name, type=kind)


async def open_watch(ctx: ApiContext, t: Target, user: str | None, path: str,
                     recursive: bool) -> AsyncIterator[FsEvent]:
    """The edge's watch, once it is in place (its `start` event consumed)."""
    try:
        if user is not None:       # root is bounded by the project's policy, like a root command
            check_exec(ctx, t.info.project, ExecRequest(cmd=f"watch {path}", user=user))
        events = t.edge.watch_dir(t.sandbox_id, path, recursive, user)
        await anext(events)
    except DsecError as e:
        raise connect_error(e) from None
    except StopAsyncIteration:
        raise ConnectError(Code.UNAVAILABLE, f"the watch of {path!r} ended before it started") from None
    return events


@dataclass
class Watcher:
    sandbox_id: str
    path: str
    events: collections.deque[pb.FilesystemEvent] = field(default_factory=lambda: collections.deque(maxlen=EVENTS_KEPT))
    error: ConnectError | None = None
    ended_at: float | None = None
    polled_at: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None


class Watchers:
    """The CreateWatcher watches of this apiserver, by id."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        self._by_id: dict[str, Watcher] = {}

    async def create(self, t: Target, user: str | None, path: str, recursive: bool) -> str:
        self._sweep()
        if sum(w.sandbox_id == t.sandbox_id for w in self._by_id.values()) >= WATCHERS_PER_SANDBOX:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"sandbox {t.e2b_id} has {WATCHERS_PER_SANDBOX} watchers; "
                                                        "stop one (WatchHandle.stop) first")
        events = await open_watch(self.ctx, t, user, path, recursive)
        watcher_id = secrets.token_hex(8)
        w = Watcher(t.sandbox_id, path)
        w.task = asyncio.create_task(self._collect(w, events), name=f"e2b-watcher-{watcher_id}")
        self._by_id[watcher_id] = w
        return watcher_id

    async def _collect(self, w: Watcher, events: AsyncIterator[FsEvent]) -> None:
        try:
            async for ev in with_keepalive(events, IDLE_CHECK_S):
                if ev is None:
                    if time.monotonic() - w.polled_at > IDLE_DROP_S:   # its client went away
                        w.error = ConnectError(Code.NOT_FOUND, f"the watch of {w.path!r} was dropped: no "
                                                               f"events were asked for in {IDLE_DROP_S:.0f} s")
                        return
                elif (m := fs_event(ev)) is not None:
                    w.events.append(m)
        except DsecError as e:
            w.error = connect_error(e)
        except Exception as e:      # a bug must end this watcher, not go unseen
            log.error("watcher failed", exc_info=e, extra={"sandbox": w.sandbox_id})
            w.error = ConnectError(Code.INTERNAL, f"the watch of {w.path!r} failed ({type(e).__name__})")
        finally:
            w.ended_at = time.monotonic()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    def _get(self, t: Target, watcher_id: str) -> Watcher:
        w = self._by_id.get(watcher_id)
        if w is None or w.sandbox_id != t.sandbox_id:    # another sandbox's watcher looks missing
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id[:40]!r} not found in sandbox {t.e2b_id}")
        return w

    def events(self, t: Target, watcher_id: str) -> list[pb.FilesystemEvent]:
        self._sweep()
        w = self._get(t, watcher_id)
        w.polled_at = time.monotonic()
        out = list(w.events)
        w.events.clear()
        if not out and w.ended_at is not None:
            self._by_id.pop(watcher_id, None)
            raise w.error or ConnectError(Code.NOT_FOUND, f"the watch of {w.path!r} has ended")
        return out

    async def remove(self, t: Target, watcher_id: str) -> None:
        w = self._get(t, watcher_id)
        del self._by_id[watcher_id]
        await self._stop(w)

    @staticmethod
    async def _stop(w: Watcher) -> None:
        if w.task is not None and not w.task.done():
            w.task.cancel()
            await asyncio.gather(w.task, return_exceptions=True)

    def _sweep(self) -> None:
        """Drop ended watchers whose end nobody collected."""
        now = time.monotonic()
        for watcher_id, w in list(self._by_id.items()):
            if w.ended_at is not None and now - w.ended_at > ENDED_KEEP_S:
                del self._by_id[watcher_id]
