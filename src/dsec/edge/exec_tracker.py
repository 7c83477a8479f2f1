"""Commands the edge follows on the caller's behalf: detached execs and execs with an
idempotency key.

A tracked exec is run by a background task that consumes the edge's own exec stream (so the
exec slot, output budget and release to the agent work as for any exec) and keeps its events
for any number of followers: each follower gets them from the beginning, then live. A retried
request with the same idempotency key follows the same exec instead of starting another.

Bounded: output is what the exec's own caps let through (the agent truncates); a terminal's
(PTY) is not capped but paced: its recent PTY_KEEP_BYTES are kept and the slowest follower
holds the rest up (in the agent, and the program in write()). A sandbox
keeps at most KEEP_FINISHED finished execs, each at most KEEP_FINISHED_S after it ended, and
at most KEEP_FINISHED_BYTES of their output together; those keyed by the SDK for its own resends
(every run() and start() without a caller's key) for SDK_KEEP_FINISHED_S, within
SDK_KEEP_FINISHED_BYTES. After
an edge restart the trackers are gone; the agent still retains what it has not released, so a
follower falls back to attaching there (Edge.exec_follow).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from dsec.types import SDK_KEY_PREFIX, DsecError, ExecEvent, ExecInfo, ExecResult

KEEP_FINISHED = 64          # finished tracked execs kept per sandbox for late followers
KEEP_FINISHED_S = 600.0     # ... and for at most this long after they ended
KEEP_FINISHED_BYTES = 32 << 20   # ... holding at most this much output together (oldest dropped first)
SDK_KEEP_FINISHED_S = 60.0  # an exec keyed by the SDK itself (SDK_KEY_PREFIX) is only there for the
SDK_KEEP_FINISHED_BYTES = 4 << 20   # SDK's resends (RETRY_WINDOW_S): kept this long, this much of them
PTY_KEEP_BYTES = 256 << 10  # a terminal's recent output kept for followers (base64): it runs for long, so
                            # older output is dropped once every follower has it, and a follower this far
                            # behind holds the terminal up (paced: the agent stops reading it)


_follower_ids = itertools.count()


@dataclass(eq=False)
class TrackedExec:
    info: ExecInfo
    idempotency_key: str | None = None
    events: list[ExecEvent] = field(default_factory=list)   # stdout/stderr/pty, in order
    base: int = 0                           # index of events[0] (a terminal's older output is dropped)
    result: ExecResult | None = None
    error: DsecError | None = None          # it could not start, or was lost (sandbox ended ...)
    ended_at: float | None = None           # monotonic
    kept_bytes: int = 0                     # output held (events and result), for the table's bound
    started: asyncio.Event = field(default_factory=asyncio.Event)   # exec_id known, or error
    task: asyncio.Task | None = None
    on_start: Callable[[], None] | None = None   # the table makes it reachable by its exec id
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _readers: dict[int, int] = field(default_factory=dict)   # follower -> index of its next event
    _read: asyncio.Event = field(default_factory=asyncio.Event)   # a follower moved on or left

    @property
    def done(self) -> bool:
        return self.ended_at is not None

    def _notify(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    async def consume(self, events: AsyncIterator[ExecEvent]) -> None:
        """Run by the background task: keep every event of the exec until it ends."""
        try:
            async for ev in events:
                if ev.type == "start":
                    self.info.exec_id = ev.exec_id or ""
                    if self.on_start is not None:
                        self.on_start()
                    self.started.set()
                elif ev.type == "exit":
                    self.result = ev.result
                    if ev.result is not None:
                        self.info.exit_code, self.info.signal = ev.result.exit_code, ev.result.signal
                        self.kept_bytes += len(ev.result.stdout) + len(ev.result.stderr)
                else:
                    self.events.append(ev)
                    self.kept_bytes += len(ev.data)
                    if ev.type == "pty":
                        self._notify()
                        await self._pace()
                        continue
                self._notify()
        except DsecError as e:
            self.error = e
        finally:
            self.info.running = False
            self.info.stdin_open = False
            self.ended_at = time.monotonic()
            self.started.set()
            self._notify()

    async def _pace(self) -> None:
        """A terminal's output beyond PTY_KEEP_BYTES: drop what every follower has read (all of
        it while none follows); wait while the slowest follower still needs it."""
        while self.kept_bytes > PTY_KEEP_BYTES and self.events:
            if min(self._readers.values(), default=self.base + len(self.events)) > self.base:
                self.kept_bytes -= len(self.events.pop(0).data)
                self.base += 1
                continue
            self._read = asyncio.Event()      # set by the next follower that moves on or leaves
            await self._read.wait()

    async def follow(self) -> AsyncIterator[ExecEvent]:
        """start, every output event so far (a terminal's recent output) and then live, exit (with
        the result, or the error as the exit event's data, as the NDJSON stream reports errors
        after its start)."""
        exec_id = self.info.exec_id
        yield ExecEvent(type="start", exec_id=exec_id)
        me = next(_follower_ids)
        i = self.base
        self._readers[me] = i
        try:
            async for ev in self._follow_from(exec_id, me, i):
                yield ev
        finally:
            del self._readers[me]
            self._read.set()

    async def _follow_from(self, exec_id: str, me: int, i: int) -> AsyncIterator[ExecEvent]:
        while True:
            wake = self._wake
            while i < self.base + len(self.events):
                i = max(i, self.base)
                yield self.events[i - self.base]
                i += 1
                self._readers[me] = i
                self._read.set()
            if self.done:
                if self.result is not None:
                    yield ExecEvent(type="exit", exec_id=exec_id, result=self.result)
                else:
                    yield ExecEvent(type="exit", exec_id=exec_id,
                                    data=self.error.message if self.error else "the exec ended without a result")
                return
            await wake.wait()

    async def wait_result(self) -> ExecResult:
        async for ev in self.follow():
            if ev.type == "exit":
                if ev.result is not None:
                    return ev.result
                if self.error is not None:
                    raise self.error
        raise DsecError("the exec ended without a result")


@dataclass(eq=False)
class ExecTable:
    """One sandbox's tracked execs and the metadata of its other running execs."""

    tracked: dict[str, TrackedExec] = field(default_factory=dict)        # exec_id -> tracked exec
    by_key: dict[str, TrackedExec] = field(default_factory=dict)         # idempotency key -> tracked exec
    running: dict[str, ExecInfo] = field(default_factory=dict)           # untracked execs now running

    def start_tracking(self, info: ExecInfo, key: str | None,
                       run: Callable[[TrackedExec], AsyncIterator[ExecEvent]]) -> TrackedExec:
        """A new tracked exec whose events come from `run(t)`, consumed by a background task."""
        self.prune()
        t = TrackedExec(info=info, idempotency_key=key)
        t.on_start = lambda: self.register(t)     # as soon as it runs, whoever waits for it or not
        if key is not None:
            self.by_key[key] = t     # before it starts: a concurrent retry waits for this one
        t.task = asyncio.create_task(self._run(t, run(t)), name=f"exec-{key or 'detached'}")
        return t

    async def _run(self, t: TrackedExec, events: AsyncIterator[ExecEvent]) -> None:
        await t.consume(events)
        if t.error is not None and not t.info.exec_id and t.idempotency_key is not None:
            self.by_key.pop(t.idempotency_key, None)     # never started: a retry may try again
        self.prune()

    def register(self, t: TrackedExec) -> None:
        """Once started: reachable by its exec id."""
        self.tracked[t.info.exec_id] = t

    def prune(self) -> None:
        now = time.monotonic()
        done = sorted((t for t in self.tracked.values() if t.ended_at is not None), key=lambda t: t.ended_at or 0.0)
        drop = [t for t in done if now - (t.ended_at or now) > _keep_s(t)]
        drop += [t for t in done[:max(0, len(done) - KEEP_FINISHED)] if t not in drop]
        for budget, group in ((SDK_KEEP_FINISHED_BYTES, [t for t in done if _sdk_keyed(t)]), (KEEP_FINISHED_BYTES, done)):
            held = sum(t.kept_bytes for t in group if t not in drop)
            for t in group:                 # oldest first, until the rest fits
                if held <= budget:
                    break
                if t not in drop:
                    drop.append(t)
                    held -= t.kept_bytes
        for t in drop:
            self.tracked.pop(t.info.exec_id, None)
            if t.idempotency_key is not None and self.by_key.get(t.idempotency_key) is t:
                del self.by_key[t.idempotency_key]

    def close(self, reason: DsecError | None = None) -> None:
        """The sandbox is going away (or the edge stops): stop following. The agent keeps
        whatever it has not released. `reason` (the sandbox failed: why) is what the execs cut
        short answer, as an untracked exec's own request would have. Never the calling task: a
        tracked exec that found its sandbox dead fails it itself, and cancelling it there would
        cut the teardown short (the sandbox's files were left behind)."""
        me = asyncio.current_task()
        for t in [*self.tracked.values(), *self.by_key.values()]:
            if t.task is not None and t.task is not me and not t.task.done():
                if reason is not None and t.error is None:
                    t.error = reason
                t.task.cancel()


def _sdk_keyed(t: TrackedExec) -> bool:
    return t.idempotency_key is not None and t.idempotency_key.startswith(SDK_KEY_PREFIX)


def _keep_s(t: TrackedExec) -> float:
    return SDK_KEEP_FINISHED_S if _sdk_keyed(t) else KEEP_FINISHED_S


def now_utc() -> datetime:
    return datetime.now(timezone.utc)
