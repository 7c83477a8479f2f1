"""Idle reclaim: the memory of sandboxes nobody used for a while leaves RAM while they run on.

A sandbox idle for `idle_s` (DSEC_RECLAIM_IDLE_S, 120 s; 0 turns this off) whose backend has
the `Reclaim` capability is reclaimed once: its page cache is dropped, its anonymous memory
goes to (zram) swap, nothing is frozen, throttled or killed (containers: parking.py without the
freeze). Not again until it was used again: a second reclaim right after the first would find
nothing but what its tasks touched since, which is exactly what they need. When the host's
memory pressure (PSI `memory some` avg10) is above `psi_limit` (DSEC_RECLAIM_PSI, 5%), the idle
threshold drops to `pressed_idle_s` (DSEC_RECLAIM_PRESSED_IDLE_S, 15 s), so more is pushed out.

Memory short (D95). While MemAvailable is below `mem_low_mb` (DSEC_RECLAIM_MEM_LOW_MB, 2 GiB)
the threshold is `squeeze_idle_s` (DSEC_RECLAIM_SQUEEZE_IDLE_S, 2 s), batches run back to
back instead of one per reaper tick, SQUEEZE_BATCH (8) of them together: a burst of VM clones (~30-50 MiB each while awake, ~15-20
dozing) is squeezed as it comes, not after the idle threshold, when the node has run out. A
create that finds the node below its reserve (admission.py) calls `squeeze()` and waits for
the memory that frees (edge/lifecycle.py, DSEC_ADMIT_RECLAIM_WAIT_S); `squeeze()` says False
when nothing idle is left to reclaim, and the create is refused at once.

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

from dsec.backends.base import DOZE_BUSY, Doze, Reclaim
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
MEM_LOW_MB = 2048        # DSEC_RECLAIM_MEM_LOW_MB: MemAvailable below this squeezes (0: off)
SQUEEZE_IDLE_S = 2.0     # DSEC_RECLAIM_SQUEEZE_IDLE_S: the threshold while squeezing
SQUEEZE_BATCH = 8        # sandboxes reclaimed together while squeezing (at least per_tick)
CPU_PSI = 50.0           # DSEC_RECLAIM_CPU_PSI: cpu some avg10 (%) above which idle VMs doze early


class Reclaimer:
    def __init__(self, live: Mapping[str, LiveSandbox], pressure: Callable[[], float | None], *,
                 idle_s: float = IDLE_S, pressed_idle_s: float = PRESSED_IDLE_S,
                 psi_limit: float = PSI_LIMIT, per_tick: int = PER_TICK,
                 mem_available: Callable[[], int | None] = lambda: None, mem_low_mb: int = 0,
                 squeeze_idle_s: float = SQUEEZE_IDLE_S,
                 cpu_pressure: Callable[[], float | None] = lambda: None, cpu_psi: float = 0.0):
        self._live = live              # the edge's live sandboxes (read only)
        self.pressure = pressure       # memory some avg10 in %, None where unknown
        self.mem_available = mem_available   # MemAvailable in MiB, None where unknown
        self.mem_low_mb = mem_low_mb
        self.cpu_pressure = cpu_pressure       # cpu some avg10 in %, None where unknown
        self.cpu_psi = cpu_psi                 # DSEC_RECLAIM_CPU_PSI (0: off)
        self.cpu_squeezed = 0                  # dozes done because the CPU was saturated
        self._wanted_until = 0.0               # a create waits for memory (squeeze()) until then
        self.squeeze_idle_s = min(squeeze_idle_s, idle_s)
        self.squeezed = 0                        # reclaims done while memory was short (since start)
        self.idle_s = idle_s
        self.pressed_idle_s = min(pressed_idle_s, idle_s)
        self.psi_limit = psi_limit
        self.per_tick = max(1, per_tick)
        self._deadlines = Deadlines()           # keyed on last activity: due at key + threshold
        self._queue: dict[str, None] = {}       # due, waiting for a slot (in order, no repeats)
        self._done: dict[str, float] = {}       # id -> its last_active_at when it was reclaimed
        self._reclaimed: dict[str, float] = {}  # ... when reclaimed but its doze found it busy
        self._light: dict[str, float] = {}      # ... when dozed for CPU only (memory not out yet)
        self._cpu_skipped: dict[str, None] = {}  # due, but left while the CPU alone was short
        self._task: asyncio.Task[list[tuple[str, int]]] | None = None
        self.reclaimed_bytes = 0                 # totals since the edge started
        self.reclaims = 0

    @classmethod
    def from_settings(cls, live: Mapping[str, LiveSandbox], probe: HostProbe, s: EdgeEnvSettings) -> Reclaimer:
        return cls(live, lambda: probe.read().stall("memory", "some"), idle_s=s.reclaim_idle_s,
                   pressed_idle_s=s.reclaim_pressed_idle_s, psi_limit=s.reclaim_psi, per_tick=s.reclaim_per_tick,
                   mem_available=lambda: probe.read().mem_available_mb, mem_low_mb=s.reclaim_mem_low_mb,
                   squeeze_idle_s=s.reclaim_squeeze_idle_s,
                   cpu_pressure=lambda: probe.read().stall("cpu", "some"), cpu_psi=s.reclaim_cpu_psi)

    @property
    def enabled(self) -> bool:
        return self.idle_s > 0

    def short(self) -> bool:
        """MemAvailable is below mem_low_mb: squeeze (short threshold, batches back to back)."""
        avail = self.mem_available() if self.mem_low_mb > 0 else None
        return avail is not None and avail < self.mem_low_mb

    def cpu_short(self) -> bool:
        """The host's CPU is saturated (PSI cpu some avg10 >= cpu_psi) and memory is not short:
        only sandboxes that can doze are squeezed, the ones whose idling costs CPU (D100)."""
        if self.cpu_psi <= 0:
            return False
        psi = self.cpu_pressure()
        return psi is not None and psi >= self.cpu_psi

    def memory_wanted(self) -> bool:
        """Memory is short, or a create waited for it a moment ago (squeeze())."""
        return self.short() or time.monotonic() < self._wanted_until

    def squeezing(self) -> bool:
        return self.memory_wanted() or self.cpu_short()

    def threshold(self) -> float:
        """The idle seconds after which a sandbox is reclaimed now."""
        if self.squeezing():
            return self.squeeze_idle_s
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
        return self._start(self.threshold())

    def squeeze(self) -> bool:
        """Memory is short now (a create waits for it): reclaim the sandboxes idle for
        squeeze_idle_s at once. True while a reclaim is under way (memory is on its way back),
        False when nothing is left to reclaim now (the caller refuses)."""
        if not self.enabled:
            return False
        self._wanted_until = time.monotonic() + 1.0     # creates poll every 0.2 s while they wait
        if self._task is not None and not self._task.done():
            return True
        # VMs stopped for the CPU alone still hold their memory: due again within a threshold
        return self._start(self.squeeze_idle_s) is not None or self._light_left()

    def _light_left(self) -> bool:
        """A sandbox dozes for the CPU alone and was not used since (its memory can go out)."""
        for sid, mark in list(self._light.items()):
            live = self._live.get(sid)
            if live is not None and live.rec.state == SandboxState.running and live.rec.last_active_at == mark:
                return True
            del self._light[sid]        # gone or used since: its entry is stale
        return False

    def _start(self, threshold: float) -> asyncio.Task[list[tuple[str, int]]] | None:
        light = self._doze_only(threshold)
        picked = self._pick(time.time(), threshold, self._batch_size(threshold), light)
        if not picked:
            return None
        self._task = asyncio.create_task(self._run(picked, threshold, light), name="edge-reclaim")
        return self._task

    def _doze_only(self, threshold: float) -> bool:
        """Squeezing for CPU alone: sandboxes that cannot doze use no CPU idle and are left to
        the idle threshold (a reclaim would cost CPU and give none back)."""
        return threshold <= self.squeeze_idle_s and not self.memory_wanted() and self.cpu_short()

    def _batch_size(self, threshold: float) -> int:
        return max(self.per_tick, SQUEEZE_BATCH) if threshold <= self.squeeze_idle_s else self.per_tick

    def _pick(self, now: float, threshold: float, size: int, doze_only: bool = False) -> list[LiveSandbox]:
        """Up to `size` sandboxes due at this threshold, the longest idle first (only those that
        can doze when `doze_only`)."""
        if not doze_only and self._cpu_skipped:       # looked at again, first
            self._queue = {**self._cpu_skipped, **self._queue}
            self._cpu_skipped.clear()
        if not self._queue and not len(self._deadlines):
            return []
        for sid in self._deadlines.due(now - threshold):
            self._queue[sid] = None
        picked: list[LiveSandbox] = []
        while self._queue and len(picked) < size:
            sid = next(iter(self._queue))
            del self._queue[sid]
            live = self._check(sid, now, threshold)
            if live is not None and doze_only and not isinstance(live.backend, Doze):
                self._cpu_skipped[sid] = None   # no CPU to gain: looked at once the CPU squeeze ends
                continue
            if live is not None:
                picked.append(live)
        return picked

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
            self._reclaimed.pop(sid, None)
            self._light.pop(sid, None)
            return None
        rec = live.rec
        if now - rec.last_active_at < threshold:
            self._deadlines.push(sid, rec.last_active_at)        # used since
        elif rec.in_flight or (self._done.get(sid) == rec.last_active_at
                               and not (self._light.get(sid) == rec.last_active_at and self.memory_wanted())):
            self._deadlines.push(sid, now)     # busy, or reclaimed already (dozing for CPU only: its
                                               # memory goes out once memory is short)
        else:
            return live
        return None

    async def _run(self, picked: list[LiveSandbox], threshold: float, light: bool = False) -> list[tuple[str, int]]:
        """Reclaim `picked`; while memory stays short, the next batch at once (not a tick later)
        and the batch's sandboxes together (a VM's doze mostly waits: its 0.2 s look at the
        CPU, QMP), not one after the other."""
        out: list[tuple[str, int]] = []
        while picked:
            if threshold <= self.squeeze_idle_s:
                done = [r for r in await asyncio.gather(*(self._one(x, threshold, light) for x in picked)) if r]
                if light:
                    self.cpu_squeezed += len(done)
                else:
                    self.squeezed += len(done)
            else:
                done = [r for x in picked if (r := await self._one(x, threshold))]
            out += done
            if not self.squeezing():
                break
            threshold = self.squeeze_idle_s
            light = self._doze_only(threshold)
            picked = self._pick(time.time(), threshold, self._batch_size(threshold), light)
        return out

    async def _one(self, live: LiveSandbox, threshold: float, light: bool = False) -> tuple[str, int] | None:
        """Reclaim (and doze) one sandbox if it is still idle: (its id, bytes), else None.
        `light` (the CPU alone is short): no reclaim, the doze only stops its CPU; a later
        pass while memory is short pushes its memory out (doze with pageout)."""
        rec = live.rec
        async with live.park_lock:            # no suspend/resume meanwhile
            mark = rec.last_active_at
            now = time.time()
            if (rec.state != SandboxState.running or rec.in_flight or now - mark < threshold
                    or self._live.get(rec.id) is not live):
                self._deadlines.push(rec.id, mark)      # changed since the tick: look again
                return None
            backend = live.backend
            assert isinstance(backend, Reclaim)
            t0 = time.monotonic()
            busy = False
            try:
                # reclaimed already in this idle period (its doze found it busy), dozing for CPU
                # only (its memory goes out now), or the CPU alone is short: doze only
                n = 0 if (light or self._reclaimed.get(rec.id) == mark or self._light.get(rec.id) == mark) \
                    else await backend.reclaim(rec.id)
                # a backend that can stop an idle sandbox's CPU (Doze) does now, if still
                # untouched (checked with no await between the check and the doze's mark)
                if (isinstance(backend, Doze) and n >= 0 and not rec.in_flight
                        and rec.last_active_at == mark and rec.state == SandboxState.running):
                    dozed = await backend.doze(rec.id, pageout=not light)
                    busy = dozed == DOZE_BUSY
                    if light and dozed >= 0:
                        self._light[rec.id] = mark
                    elif not busy:
                        self._light.pop(rec.id, None)
                    n += max(0, dozed)
            except Exception as e:   # its cgroup went, a kernel refusal: not again this idle period
                log.warning("idle reclaim failed", extra={"sandbox": rec.id, "error": str(e) or repr(e)})
                n = -1
            ms = round((time.monotonic() - t0) * 1000, 1)
            if busy:      # a guest just restored often still works for a while: asked again
                self._reclaimed[rec.id] = mark       # one threshold later, not left awake
            else:
                self._done[rec.id] = mark
                self._reclaimed.pop(rec.id, None)
            self._deadlines.push(rec.id, time.time())
        if n < 0:
            return None
        self.reclaims += 1
        self.reclaimed_bytes += n
        log.info("idle sandbox memory reclaimed",
                 extra={"sandbox": rec.id, "bytes": n, "mib": round(n / (1 << 20), 1), "ms": ms,
                        "idle_s": round(now - mark, 1), "threshold_s": threshold})
        return rec.id, n
