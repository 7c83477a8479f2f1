"""Admission that waits for idle reclaim when the node is short of memory (issue 31, D95), paced
by what was admitted meanwhile (D100).

A burst of VM clones outruns their dozing: each is awake (~30-50 MiB) until it has been idle a
while, and MemAvailable touches the reserve (DSEC_MEM_RESERVE_MB) although most of it would come
back within seconds once the idle ones doze. A create short of memory therefore asks the
reclaimer to squeeze now (reclaim.py `squeeze`) and checks again every POLL_S, for at most
DSEC_ADMIT_RECLAIM_WAIT_S. It is refused as before, at once, when nothing idle is left to
reclaim, and after the wait when reclaim did not free enough; the refusal then says it waited.
Every other refusal (count, ceilings, PSI, disk) is immediate, as before.

Pacing. MemAvailable shows a new sandbox's memory only once its runtime has allocated it (a
clone's QEMU, a second or two after admission) and is read at most once a second: 4 creates
waiting in flight all saw the same freed memory and were admitted together, each counting on
it. So a create admitted near the floor (after waiting, or with less than CLAIM_SPAN sandboxes'
worth above it) leaves a *claim* of what it will take resident (the backend's
`start_resident_mb`, at least DSEC_ADMIT_SANDBOX_MB) for CLAIM_S seconds, and every admission
counts the live claims as gone. A create short only because of claims waits for them to age
out (bounded as above), whether or not reclaim is under way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from dsec.edge.admission import Admission, MemoryShort
from dsec.edge.reclaim import Reclaimer
from dsec.types import NodeStatus

log = logging.getLogger("dsec.edge")

POLL_S = 0.2      # MemAvailable itself is read at most once a second (pressure.HostProbe)
CLAIM_S = 3.0     # a new sandbox's memory shows in MemAvailable by then (start + 1 s probe cache)
CLAIM_SPAN = 4    # closer to the floor than this many claims: claimed (DSEC_CREATE_PARALLEL's default)


class Claims:
    """Memory of recently admitted creates that MemAvailable may not show yet."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._held: deque[tuple[float, int]] = deque()    # (admitted at, MiB), oldest first
        self.paced = 0        # admissions that waited for claims (since start)

    def held_mb(self) -> int:
        now = self._clock()
        while self._held and now - self._held[0][0] >= CLAIM_S:
            self._held.popleft()
        return sum(mb for _, mb in self._held)

    def add(self, mb: int) -> None:
        if mb > 0:
            self._held.append((self._clock(), mb))


async def admit(admission: Admission, status: Callable[[], Awaitable[NodeStatus]], reclaimer: Reclaimer,
                cpu_cores: float, memory_mb: int, wait_s: float, claims: Claims | None = None,
                claim_mb: int = 0, on_short: Callable[[], None] | None = None) -> float:
    """Admit or raise; returns the seconds it waited for reclaim (0.0 when it did not).
    `on_short` is called once, at the first shortage (the edge drops its automatic pools)."""
    t0: float | None = None
    claims = claims if claims is not None else Claims()
    claim_mb = max(claim_mb, admission.sandbox_mb)
    paced = False
    while True:
        node = await status()
        held = claims.held_mb()      # after the await: a create admitted meanwhile has claimed
        try:
            admission.admit(node, cpu_cores, memory_mb, held)
        except MemoryShort as e:
            now = time.monotonic()
            if t0 is None and on_short is not None:
                on_short()
            t0 = now if t0 is None else t0
            # short only by claims: their memory is being taken, not missing; wait them out
            paced = paced or e.claims_only
            if now - t0 >= wait_s or not (e.claims_only or reclaimer.squeeze()):
                if now > t0:
                    e.message = (f"{e.message}; waited {now - t0:.1f} s for idle sandboxes' memory to be "
                                 "reclaimed (DSEC_ADMIT_RECLAIM_WAIT_S)")
                    e.args = (e.message,)
                raise
            await asyncio.sleep(POLL_S)
            continue
        avail = admission.probe.read().mem_available_mb
        near = avail is not None and avail - held < admission.mem_reserve_mb + admission.sandbox_mb + CLAIM_SPAN * claim_mb
        if t0 is not None or held or near:
            claims.add(claim_mb)       # admitted near the floor: the next ones count it as gone
        if t0 is None:
            return 0.0
        claims.paced += paced
        waited = time.monotonic() - t0
        log.info("create waited for idle reclaim", extra={"ms": round(waited * 1000, 1),
                                                          "squeezed": reclaimer.squeezed, "paced": paced,
                                                          "claimed_mb": held})
        return waited
