"""Host memory as benchmarks see it: MemAvailable, read after the kernel settles."""

from __future__ import annotations

import statistics
import time


def mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def settled_mem_available_mib() -> float:
    """MemAvailable after the kernel had a moment to settle (median of three reads, 1 s apart)."""
    vals = []
    for _ in range(3):
        time.sleep(1.0)
        vals.append(mem_available_mib())
    return statistics.median(vals)
