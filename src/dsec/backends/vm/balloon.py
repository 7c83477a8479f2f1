"""The VM's virtio-balloon: how an idle guest's memory goes back to the host.

Every VM has a `virtio-balloon` device with `free-page-reporting=on` and `deflate-on-oom=on`
(qemu.Machine). Two ways memory leaves:

- Free page reporting (always on, the guest's doing): the guest kernel tells QEMU about free
  2 MiB blocks of its buddy allocator every ~2 s, and QEMU drops its copies of them
  (madvise DONTNEED). Memory a guest program frees is back on the host within seconds.
- A squeeze (`squeeze`, the edge's idle reclaim through the `Reclaim` capability): page cache
  is not free memory, so an idle guest keeps it. The balloon target goes down to a quarter of
  the guest's RAM (at least 64 MiB) for a moment: the guest drops page cache to hand pages
  over, and QEMU gives each handed-over page back. Then the target goes back to the full size
  at once, so the guest can grow again as soon as it is used. The guest's balloon driver
  allocates without retrying, and `deflate-on-oom` hands pages back before the guest's OOM
  killer would act: nothing is killed; a guest whose memory is all in use just hands over less.
  The balloon first takes the guest's free memory (back on the host already) and the guest
  kernel zeroes each page it allocates: under TCG ~25 ms of a core per MiB, so by default
  (`DSEC_VM_RECLAIM=auto`) only KVM guests are squeezed.

Containment: the balloon only ever takes memory from the guest. What the guest says it gave
(reported or inflated pages) is discarded from *its own* RAM; it cannot claim host memory, and
a template clone's discards never reach the shared template file (ramshim.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from dsec.backends.vm.qemu import Qmp
from dsec.types import SandboxFailed

log = logging.getLogger("dsec.backends.vm")

SQUEEZE_S = 15.0         # longest squeeze: the default of DSEC_VM_RECLAIM_SQUEEZE_S
STALL_S = 2.0            # the balloon stopped moving this long: the guest has no more to give
FLOOR_MB = 64


def squeeze_enabled(accel: str, mode: str = "auto") -> bool:
    """DSEC_VM_RECLAIM: idle squeezes "auto" under KVM only (TCG emulates the guest zeroing every
    page it gives: ~25 ms of a core per MiB measured here), "1" always, "0" never."""
    return mode == "1" or (mode == "auto" and accel == "kvm")


def floor_bytes(memory_mb: int) -> int:
    return max(FLOOR_MB, memory_mb // 4) << 20


async def squeeze(d: Path, name: str, memory_mb: int, pid: int | None, max_s: float | None = None) -> int:
    """Squeeze the VM in dir `d` and let go again. Returns the bytes of QEMU's private memory
    that left RAM."""
    full, floor = memory_mb << 20, floor_bytes(memory_mb)
    before = rss_anon_bytes(pid) if pid is not None else None
    t0 = time.monotonic()
    try:
        async with Qmp(d / "qmp.sock", name) as q:
            try:
                await q.run("balloon", value=floor)
                await settle(q, floor, SQUEEZE_S if max_s is None else max_s)
            finally:
                await q.run("balloon", value=full)
    except SandboxFailed:
        raise
    except Exception as e:        # QMP refused, or QEMU went away
        raise SandboxFailed(f"VM {name}: balloon reclaim failed ({e.__class__.__name__}: {e})") from e
    after = rss_anon_bytes(pid) if pid is not None else None
    freed = max(0, before - after) if before is not None and after is not None else 0
    log.debug("vm balloon squeeze", extra={"sandbox": name, "bytes": freed,
                                            "seconds": round(time.monotonic() - t0, 2)})
    return freed


async def settle(q: Qmp, target: int, max_s: float = SQUEEZE_S) -> None:
    """Wait until the balloon reached `target` or stopped moving, at most `max_s`."""
    deadline = time.monotonic() + max_s
    last, moved = -1, time.monotonic()
    while time.monotonic() < deadline:
        actual = int((await q.run("query-balloon"))["actual"])
        if actual <= target:
            return
        if actual != last:
            last, moved = actual, time.monotonic()
        elif time.monotonic() - moved > STALL_S:
            return
        await asyncio.sleep(0.1)


async def release(d: Path, name: str, memory_mb: int) -> None:
    """Balloon target back to the VM's full RAM (after an edge died during a squeeze)."""
    try:
        async with Qmp(d / "qmp.sock", name) as q:
            await q.run("balloon", value=memory_mb << 20)
    except Exception as e:    # the reaper fails a VM that is gone: this is only a reset
        log.warning("could not reset the VM balloon", extra={"sandbox": name, "error": repr(e)})


def rss_anon_bytes(pid: int) -> int | None:
    """A QEMU's private anonymous memory: the guest RAM it owns (a clone: its unshared pages)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
