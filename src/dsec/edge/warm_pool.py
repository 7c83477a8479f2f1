"""Warm pools: containers started ahead of demand, per environment, claimed by creates.

A pool is configured per node as `image:size` items (DSEC_WARM_POOL="debian-python:8,busybox:4"
or `set_targets`). Each pool keeps `size` sandboxes of that image started and idle (their agent
answering, connected), owned by the node (counted by admission, in no project's list). A create
whose request has the same pool key (the backend's `WarmClaim.warm_key`: image layers and every
other setting fixed at start) takes one instead of starting a container: the edge gives it the
caller's record (its own id, project, labels, env, TTL, lifetime) and the backend its limits and
network policy. A claimed sandbox is never handed out again: when it stops it is destroyed like
any other, so nothing of one tenant can reach another. Taking one wakes the refill task, which
starts replacements in the background, `parallel` at a time.

Idle pool sandboxes have no record in the edge's database: they are a cache. An edge that stops
destroys them; one that crashed finds them at its next start as orphans (runtime state without a
record) and destroys them; either way the pools are refilled. Decision record: D28.

Besides the operator's pools, the node keeps automatic ones (warm_auto.py, D99): a burst of one
shape sets that image's pool to the burst's size, under DSEC_WARM_POOL_AUTO in all; the
operator's targets win for their images. Automatic pools refill only while creates pause and
the edge's room check passes (`room`), and end at once when a tenant's create is refused or
waits (`drop_auto`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

from dsec.agent.client import AgentClient
from dsec.backends.base import Backend
from dsec.edge.records import SandboxRecord
from dsec.edge.warm_auto import AutoPools
from dsec.types import DsecError, InvalidArgument, NAME_RE

log = logging.getLogger("dsec.edge.warm_pool")

ENV = "DSEC_WARM_POOL"
MAX_SIZE = 1024                # per pool: a typo must not start thousands of containers
RETRY_S = 5.0                  # after a failed start (refused by admission, broken image)
RECHECK_S = 30.0               # the pools' keys are re-resolved this often (an image re-published)
# Refills wait until claims pause this long (at most DEFER_MAX_S): a container start costs tens
# of ms of CPU (crun, mounts), which a burst's claims and their first commands need more.
QUIET_S = 1.0
DEFER_MAX_S = 5.0
FIX = "use a comma-separated list of image:size, e.g. DSEC_WARM_POOL='debian-python:8,busybox:4'"


@dataclass(frozen=True)
class PoolTarget:
    image: str
    size: int


def parse_targets(raw: str, field: str = ENV) -> list[PoolTarget]:
    """'debian-python:8,busybox:4' -> targets; an image without ':size' gets 1."""
    out: dict[str, PoolTarget] = {}
    for item in (x.strip() for x in raw.split(",")):
        if not item:
            continue
        image, sep, size_s = item.rpartition(":")
        if not sep:
            image, size_s = item, "1"
        try:
            size = int(size_s)
        except ValueError:
            raise InvalidArgument(f"{field}: {item!r} has no valid size after ':'", field=field, fix=FIX) from None
        if not re.match(NAME_RE, image):
            raise InvalidArgument(f"{field}: {image!r} is not an image name", field=field, fix=FIX)
        if not 0 <= size <= MAX_SIZE:
            raise InvalidArgument(f"{field}: size {size} of {image!r} is outside 0..{MAX_SIZE}", field=field, fix=FIX)
        out[image] = PoolTarget(image, size)
    return list(out.values())


@dataclass(eq=False)
class WarmSandbox:
    """An idle pool sandbox: started, its agent connected, never used."""

    rec: SandboxRecord        # the node's (project 'system'): what admission counts while it waits
    key: Hashable
    backend: Backend
    agent: AgentClient
    ready_at: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return self.rec.id


# What the pool needs of the edge: start one (prepare, admit, create, connect) and free one.
Starter = Callable[[PoolTarget], Awaitable[WarmSandbox]]
KeyOf = Callable[[PoolTarget], Awaitable[Hashable | None]]
Dropper = Callable[[WarmSandbox], Awaitable[None]]
# Why an automatic pool may not start one more sandbox now (None: it may).
RoomCheck = Callable[[PoolTarget], Awaitable[str | None]]


class WarmPools:
    def __init__(self, targets: list[PoolTarget], start: Starter, key_of: KeyOf, drop: Dropper, parallel: int = 2,
                 auto: AutoPools | None = None, room: RoomCheck | None = None):
        self._conf = {t.image: t for t in targets}      # the operator's (DSEC_WARM_POOL, set_targets)
        self.auto = auto or AutoPools(0, 300.0)
        self._room = room
        self._targets: dict[str, PoolTarget] = {}        # the operator's and the automatic ones, merged
        self._merge()
        self._start, self._key_of, self._drop = start, key_of, drop
        self._idle: dict[Hashable, deque[WarmSandbox]] = {}
        self._keys: dict[str, Hashable] = {}           # image -> its pool key, as last resolved
        self._starting: dict[str, int] = {}            # image -> starts in flight
        self._errors: dict[str, str] = {}              # image -> the last start's error
        self._retry_at: dict[str, float] = {}
        self._slots = asyncio.Semaphore(parallel)
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._starts: set[asyncio.Task[None]] = set()
        self._drains: set[asyncio.Task[None]] = set()   # finished at close, never cancelled: no leak
        self._rechecked = 0.0
        self.claims = 0
        self._last_create = 0.0   # monotonic: the last create (claimed or cold): refills wait for a pause
        self.misses = 0        # creates that matched a pool's key but found it empty

    @property
    def targets(self) -> list[PoolTarget]:
        """The operator's targets (automatic pools apart: `auto.pools`)."""
        return list(self._conf.values())

    def _merge(self) -> None:
        """The pools to keep: the operator's, then automatic ones for the other images."""
        merged = dict(self._conf)
        for image, p in self.auto.pools.items():
            if image not in merged:
                merged[image] = PoolTarget(image, p.size)
        self._targets = merged

    def _is_auto(self, image: str) -> bool:
        return image not in self._conf and image in self.auto.pools

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._refill_loop(), name="warm-pool-refill")
            self._wake.set()

    def set_targets(self, targets: list[PoolTarget]) -> None:
        """Replace the configuration: sandboxes beyond it leave the pools at once (destroyed in
        the background); missing ones are started by the refill task."""
        self._conf = {t.image: t for t in targets}
        self._merge()
        self._retry_at.clear()
        self._drain()     # at once: a create from here on never claims one being drained
        self._wake.set()

    def _drain(self) -> list[WarmSandbox]:
        excess = self._trim()
        if excess:
            task = asyncio.create_task(self._drop_all(excess), name="warm-pool-drain")
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        return excess

    def _trim(self) -> list[WarmSandbox]:
        """Take out (synchronously) the idle sandboxes beyond what the pools want: of keys no
        pool has any more (image re-published, pool removed) or beyond a pool's size."""
        wanted: dict[Hashable, int] = {}
        for image, t in self._targets.items():
            if image in self._keys:
                wanted[self._keys[image]] = wanted.get(self._keys[image], 0) + t.size
        out: list[WarmSandbox] = []
        for key in list(self._idle):
            q = self._idle[key]
            while len(q) > wanted.get(key, 0):
                out.append(q.pop())
            if not q:
                del self._idle[key]
        return out

    async def _drop_all(self, ws: list[WarmSandbox]) -> None:
        async def one(w: WarmSandbox) -> None:
            async with self._slots:
                await self._drop_logged(w)
        await asyncio.gather(*(one(w) for w in ws))

    def take(self, key: Hashable | None) -> WarmSandbox | None:
        """An idle sandbox of this key, or None (no such pool, or it is empty). Synchronous:
        two concurrent creates never get the same one."""
        if key is None:
            return None
        q = self._idle.get(key)
        if q is None:
            if key in self._keys.values():
                self.misses += 1
            return None
        w = q.popleft()
        if not q:
            del self._idle[key]
        self.claims += 1
        self._last_create = time.monotonic()
        self._wake.set()
        return w

    def note_create(self) -> None:
        """A create began on this node (claimed or not): refills wait until creates pause."""
        self._last_create = time.monotonic()

    def observe(self, image: str, key: Hashable) -> None:
        """A container create of this image and pool key (claimed or cold): counted towards a
        burst, which may make or grow the image's automatic pool (warm_auto.py)."""
        if image not in self._conf and self.auto.observe(image, key):   # the operator's pool wins
            self._merge()
            self._wake.set()

    def auto_held(self) -> int:
        """Sandboxes the automatic pools hold now (idle or starting): they give way to any create."""
        return sum(self._starting.get(image, 0) + self._idle_of(image) for image in self.auto.pools
                   if self._is_auto(image))

    def _idle_of(self, image: str) -> int:
        key = self._keys.get(image)
        return len(self._idle.get(key, ())) if key is not None else 0

    def drop_auto(self, reason: str) -> list[WarmSandbox]:
        """A tenant's create was refused or waited: every automatic pool ends now. Returns the
        idle sandboxes taken out (being destroyed in the background): the caller releases their
        share of the node at once."""
        if not self.auto.drop_all(reason):
            return []
        self._merge()
        return self._drain()

    def set_auto_max(self, n: int) -> None:
        self.auto.set_max(n)
        self._merge()
        self._drain()
        self._wake.set()

    def give_back(self, w: WarmSandbox) -> None:
        """A taken sandbox the create did not use after all (refused by admission): unused still."""
        self._idle.setdefault(w.key, deque()).appendleft(w)
        self.claims -= 1

    def waiting(self) -> list[WarmSandbox]:
        return [w for q in self._idle.values() for w in q]

    def status(self) -> dict[str, object]:
        """The operator's pools under `pools`, the automatic ones apart under `auto` (with the
        burst that made each), and the automatic pools' bound and state."""
        out: dict[str, dict[str, object]] = {}
        auto: dict[str, dict[str, object]] = {}
        for image, t in self._targets.items():
            one: dict[str, object] = {"size": t.size, "idle": self._idle_of(image),
                                      "starting": self._starting.get(image, 0), "error": self._errors.get(image)}
            if self._is_auto(image):
                one["burst"] = self.auto.pools[image].burst
                auto[image] = one
            else:
                out[image] = one
        return {"pools": out, "auto": auto, **self.auto.status(), "claims": self.claims, "misses": self.misses}

    async def close(self) -> None:
        """Stop refilling and free every idle sandbox (a cache: nothing of it is kept)."""
        # the flag ends the loop even if a cancel is lost (3.11's wait_for could swallow one
        # that raced its timeout, leaving close() waiting on a loop that went round again)
        self._closing = True
        self._wake.set()
        tasks = [t for t in (self._task, *self._starts) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, *self._drains, return_exceptions=True)
        self._task = None
        idle, self._idle = self.waiting(), {}
        await asyncio.gather(*(self._drop_logged(w) for w in idle))

    async def _drop_logged(self, w: WarmSandbox) -> None:
        try:
            await self._drop(w)
        except Exception:
            log.exception("could not free a warm pool sandbox", extra={"sandbox": w.id})

    # -- refill ------------------------------------------------------------------------------
    async def _refill_loop(self) -> None:
        while not self._closing:
            try:
                # automatic pools: looked at each QUIET_S (they start once creates pause, end on time)
                async with asyncio.timeout(QUIET_S if self.auto.pools else RETRY_S):
                    await self._wake.wait()
            except TimeoutError:
                pass
            if self._closing:
                return
            self._wake.clear()
            if self.auto.expire():
                self._merge()
            deferred = time.monotonic()
            while time.monotonic() - self._last_create < QUIET_S and time.monotonic() - deferred < DEFER_MAX_S:
                await asyncio.sleep(QUIET_S)
            try:
                await self._refill_once()
            except Exception:     # the loop must outlive any one bad pool
                log.exception("warm pool refill failed")

    async def _refill_once(self) -> None:
        now = time.monotonic()
        if now >= self._rechecked + RECHECK_S or set(self._keys) != set(self._targets):
            self._rechecked = now
            for image, t in self._targets.items():
                try:
                    key = await self._key_of(t)
                except DsecError as e:
                    self._errors[image] = e.message
                    key = None
                if key is None:
                    self._keys.pop(image, None)
                else:
                    self._keys[image] = key
            for image in set(self._keys) - set(self._targets):
                del self._keys[image]
        mismatched = [i for i, p in self.auto.pools.items() if self._is_auto(i) and i in self._keys
                      and self._keys[i] != p.key]
        for image in mismatched:      # the image's pool would not answer the burst's shape
            self.auto.not_poolable(image)
        if mismatched:
            self._merge()
        self._drain()
        # automatic pools start only while no create comes (uncapped: a refill of the node's own
        # choosing never shares the CPU with a burst)
        quiet = now - self._last_create >= QUIET_S
        for image, t in self._targets.items():
            key = self._keys.get(image)
            if key is None or now < self._retry_at.get(image, 0.0):
                continue
            if self._is_auto(image) and not quiet:
                continue
            missing = t.size - len(self._idle.get(key, ())) - self._starting.get(image, 0)
            for _ in range(max(0, missing)):
                self._starting[image] = self._starting.get(image, 0) + 1
                task = asyncio.create_task(self._start_one(t), name=f"warm-{image}")
                self._starts.add(task)
                task.add_done_callback(self._starts.discard)

    async def _start_one(self, t: PoolTarget) -> None:
        try:
            async with self._slots:
                if t.image not in self._targets:     # reconfigured while queued
                    return
                if self._is_auto(t.image):
                    # the node's own choice: only while creates pause and the node has room to spare
                    if time.monotonic() - self._last_create < QUIET_S:    # creates resumed
                        self._retry_at[t.image] = time.monotonic() + QUIET_S
                        return
                    why = await self._room(t) if self._room is not None else None
                    if why is not None:
                        self._errors[t.image] = why
                        self._retry_at[t.image] = time.monotonic() + RETRY_S
                        return
                w = await self._start(t)
            if self._keys.get(t.image) != w.key or t.image not in self._targets:
                await self._drop_logged(w)            # the pool changed meanwhile
                return
            self._idle.setdefault(w.key, deque()).append(w)
            self._errors.pop(t.image, None)
        except DsecError as e:
            self._errors[t.image] = e.message
            self._retry_at[t.image] = time.monotonic() + RETRY_S
            log.warning("could not start a warm pool sandbox", extra={"image": t.image, "error": e.message})
        except Exception as e:
            self._errors[t.image] = repr(e)
            self._retry_at[t.image] = time.monotonic() + RETRY_S
            log.exception("could not start a warm pool sandbox", extra={"image": t.image})
        finally:
            self._starting[t.image] -= 1
