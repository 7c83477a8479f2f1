"""Host memory as benchmarks see it: MemAvailable, read after the kernel settles."""

from __future__ import annotations

import statistics
import time


def meminfo_mib(key: str) -> float | None:
    """A /proc/meminfo value in MiB (None: the kernel has no such line)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return None


def mem_available_mib() -> float:
    mib = meminfo_mib("MemAvailable")
    if mib is None:
        raise RuntimeError("no MemAvailable in /proc/meminfo")
    return mib


def settled_mem_available_mib(reads: int = 3) -> float:
    """MemAvailable after the kernel had a moment to settle (median of `reads` reads, 1 s apart:
    a neighbour's spikes drop out)."""
    vals = []
    for _ in range(reads):
        time.sleep(1.0)
        vals.append(mem_available_mib())
    return statistics.median(vals)
