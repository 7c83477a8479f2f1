"""Idle reclaim: the memory of sandboxes nobody used for a while leaves RAM while they run on.

A sandbox idle for `idle_s` (DSEC_RECLAIM_IDLE_S, 120 s; 0 turns this off) whose backend has
the `Reclaim` capability is reclaimed once: its page cache is dropped, its anonymous memory
goes to (zram) swap, nothing is frozen, throttled or killed (containers: parking.py without the
freeze). Not again until it was used again: a second reclaim right after the first would find
nothing but what its tasks touched since, which is exactly what they need. When the host's
memory pressure (PSI `memory some` avg10) is above `psi_limit` (DSEC_RECLAIM_PSI, 5%), the idle
threshold drops to `pressed_idle_s` (DSEC_RECLAIM_PRESSED_IDLE_S, 15 s), so more is pushed out.

Cost: a reclaim is CPU and I/O (~2.5-3.5 ms per MiB), so at most `per_tick`
(DSEC_RECLAIM_PER_TICK, 4) start per reaper tick, one at a time, in a thread (never on the
event loop); a tick that finds the previous batch still running starts none. Skipped: sandboxes
with a request in flight (a followed detached exec counts), parked or parking ones (the
reclaim holds the sandbox's park lock, so a suspend waits for it), backends without the
capability (never even queued). A backend that can also doze (Doze: VMs stop their vCPUs and
push their memory to zram, backends/vm/doze.py) is asked to right after its reclaim; the
channel (channel.py) wakes it before the next use.

Like the reaper (deadlines.py), a tick costs O(due), not O(sandboxes): a heap keyed on each
sandbox's last activity pops the ones idle past the threshold in force now (a threshold that
drops under pressure needs no re-keying), and each popped one is checked against its current
record: used since -> pushed again at its new activity time; busy or already reclaimed in this
idle period -> looked at again one threshold later. The edge feeds it from `_schedule` (create,
resume, recovery and every reaper pass over the sandbox) and drives it from the reap loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from dsec.backends.base import Doze, Reclaim
from dsec.edge.deadlines import Deadlines
from dsec.types import SandboxState

if TYPE_CHECKING:
    from dsec.edge.live import LiveSandbox
    from dsec.edge.pressure import HostProbe
    from dsec.edge.records import SandboxRecord
    from dsec.settings import EdgeEnvSettings

log = logging.getLogger("dsec.edge")

IDLE_S = 120.0           # DSEC_RECLAIM_IDLE_S
PRESSED_IDLE_S = 15.0    # DSEC_RECLAIM_PRESSED_IDLE_S: the threshold under memory pressure
PSI_LIMIT = 5.0          # DSEC_RECLAIM_PSI: memory some avg10 (%) above which it applies
PER_TICK = 4             # DSEC_RECLAIM_PER_TICK


class Reclaimer:
    def __init__(self, live: Mapping[str, LiveSandbox], pressure: Callable[[], float | None], *,
                 idle_s: float = IDLE_S, pressed_idle_s: float = PRESSED_IDLE_S,
                 psi_limit: float = PSI_LIMIT, per_tick: int = PER_TICK):
        self._live = live              # the edge's live sandboxes (read only)
        self.pressure = pressure       # memory some avg10 in %, None where unknown
        self.idle_s = idle_s
        self.pressed_idle_s = min(pressed_idle_s, idle_s)
        self.psi_limit = psi_limit
        self.per_tick = max(1, per_tick)
        self._deadlines = Deadlines()           # keyed on last activity: due at key + threshold
        self._queue: dict[str, None] = {}       # due, waiting for a slot (in order, no repeats)
        self._done: dict[str, float] = {}       # id -> its last_active_at when it was reclaimed
        self._task: asyncio.Task[list[tuple[str, int]]] | None = None
        self.reclaimed_bytes = 0                 # totals since the edge started
        self.reclaims = 0

    @classmethod
    def from_settings(cls, live: Mapping[str, LiveSandbox], probe: HostProbe, s: EdgeEnvSettings) -> Reclaimer:
        return cls(live, lambda: probe.read().stall("memory", "some"), idle_s=s.reclaim_idle_s,
                   pressed_idle_s=s.reclaim_pressed_idle_s, psi_limit=s.reclaim_psi, per_tick=s.reclaim_per_tick)

    @property
    def enabled(self) -> bool:
        return self.idle_s > 0

    def threshold(self) -> float:
        """The idle seconds after which a sandbox is reclaimed now."""
        psi = self.pressure()
        return self.pressed_idle_s if psi is not None and psi > self.psi_limit else self.idle_s

    # -- the edge's hooks ----------------------------------------------------------------
    def watch(self, rec: SandboxRecord) -> None:
        """The reaper (re)scheduled this sandbox: look at it once it has been idle long enough."""
        if not self.enabled or rec.state != SandboxState.running:
            return
        live = self._live.get(rec.id)
        if live is not None and isinstance(live.backend, Reclaim):
            self._deadlines.push(rec.id, rec.last_active_at)

    def tick(self) -> asyncio.Task[list[tuple[str, int]]] | None:
        """Start reclaiming (in the background) up to per_tick sandboxes that are due; none
        while the previous batch still runs. Returns the batch's task, if one started."""
        if not self.enabled or (self._task is not None and not self._task.done()):
            return None
        if not self._queue and not len(self._deadlines):
            return None
        now = time.time()
        threshold = self.threshold()
        for sid in self._deadlines.due(now - threshold):
            self._queue[sid] = None
        picked: list[LiveSandbox] = []
        while self._queue and len(picked) < self.per_tick:
            sid = next(iter(self._queue))
            del self._queue[sid]
            live = self._check(sid, now, threshold)
            if live is not None:
                picked.append(live)
        if not picked:
            return None
        self._task = asyncio.create_task(self._run(picked, threshold), name="edge-reclaim")
        return self._task

    async def run_once(self) -> list[tuple[str, int]]:
        """One tick, waited for: (sandbox id, bytes) of each reclaim it did (tests)."""
        task = self.tick()
        return await task if task is not None else []

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # -- the work ------------------------------------------------------------------------
    def _check(self, sid: str, now: float, threshold: float) -> LiveSandbox | None:
        """The sandbox if it is to be reclaimed now; else it is pushed back or dropped."""
        live = self._live.get(sid)
        if live is None or live.rec.state != SandboxState.running or not isinstance(live.backend, Reclaim):
            self._done.pop(sid, None)     # gone or parked (a resume schedules it again)
            return None
        rec = live.rec
        if now - rec.last_active_at < threshold:
            self._deadlines.push(sid, rec.last_active_at)        # used since
        elif rec.in_flight or self._done.get(sid) == rec.last_active_at:
            self._deadlines.push(sid, now)                       # busy, or reclaimed already
        else:
            return live
        return None

    async def _run(self, picked: list[LiveSandbox], threshold: float) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for live in picked:
            rec = live.rec
            async with live.park_lock:            # no suspend/resume meanwhile
                mark = rec.last_active_at
                now = time.time()
                if (rec.state != SandboxState.running or rec.in_flight or now - mark < threshold
                        or self._live.get(rec.id) is not live):
                    self._deadlines.push(rec.id, mark)      # changed since the tick: look again
                    continue
                backend = live.backend
                assert isinstance(backend, Reclaim)
                t0 = time.monotonic()
                try:
                    n = await backend.reclaim(rec.id)
                    # a backend that can stop an idle sandbox's CPU (Doze) does now, if still
                    # untouched (checked with no await between the check and the doze's mark)
                    if (isinstance(backend, Doze) and n >= 0 and not rec.in_flight
                            and rec.last_active_at == mark and rec.state == SandboxState.running):
                        n += max(0, await backend.doze(rec.id))
                except Exception as e:   # its cgroup went, a kernel refusal: not again this idle period
                    log.warning("idle reclaim failed", extra={"sandbox": rec.id, "error": str(e) or repr(e)})
                    n = -1
                ms = round((time.monotonic() - t0) * 1000, 1)
                self._done[rec.id] = mark
                self._deadlines.push(rec.id, time.time())
            if n >= 0:
                self.reclaims += 1
                self.reclaimed_bytes += n
                out.append((rec.id, n))
                log.info("idle sandbox memory reclaimed",
                         extra={"sandbox": rec.id, "bytes": n, "mib": round(n / (1 << 20), 1), "ms": ms,
                                "idle_s": round(now - mark, 1), "threshold_s": threshold})
        return out
