"""Admission that waits for idle reclaim when the node is short of memory (issue 31, D95).

A burst of VM clones outruns their dozing: each is awake (~30-50 MiB) until it has been idle a
while, and MemAvailable touches the reserve (DSEC_MEM_RESERVE_MB) although most of it would come
back within seconds once the idle ones doze. A create short of memory therefore asks the
reclaimer to squeeze now (reclaim.py `squeeze`) and checks again every POLL_S, for at most
DSEC_ADMIT_RECLAIM_WAIT_S. It is refused as before, at once, when nothing idle is left to
reclaim, and after the wait when reclaim did not free enough; the refusal then says it waited.
Every other refusal (count, ceilings, PSI, disk) is immediate, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from dsec.edge.admission import Admission, MemoryShort
from dsec.edge.reclaim import Reclaimer
from dsec.types import NodeStatus

log = logging.getLogger("dsec.edge")

POLL_S = 0.2      # MemAvailable itself is read at most once a second (pressure.HostProbe)


async def admit(admission: Admission, status: Callable[[], Awaitable[NodeStatus]], reclaimer: Reclaimer,
                cpu_cores: float, memory_mb: int, wait_s: float, on_short: Callable[[], None] | None = None) -> float:
    """Admit or raise; returns the seconds it waited for reclaim (0.0 when it did not).
    `on_short` is called once, at the first shortage (the edge drops its automatic pools)."""
    t0: float | None = None
    while True:
        try:
            admission.admit(await status(), cpu_cores, memory_mb)
        except MemoryShort as e:
            now = time.monotonic()
            if t0 is None and on_short is not None:
                on_short()
            t0 = now if t0 is None else t0
            if now - t0 >= wait_s or not reclaimer.squeeze():
                if now > t0:
                    e.message = (f"{e.message}; waited {now - t0:.1f} s for idle sandboxes' memory to be "
                                 "reclaimed (DSEC_ADMIT_RECLAIM_WAIT_S)")
                    e.args = (e.message,)
                raise
            await asyncio.sleep(POLL_S)
            continue
        if t0 is None:
            return 0.0
        waited = time.monotonic() - t0
        log.info("create waited for idle reclaim", extra={"ms": round(waited * 1000, 1),
                                                          "squeezed": reclaimer.squeezed})
        return waited
