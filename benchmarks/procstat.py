"""Processes' CPU from /proc/PID/stat, for the benchmark scripts (each runs with benchmarks/ on
sys.path: `python benchmarks/X.py`, or PYTHONPATH=...:benchmarks for the *_ab drivers).

Fields are counted after the command name (which may hold spaces and parentheses): 0 is the
state, 1 the parent pid, 11-14 utime, stime, cutime, cstime in clock ticks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

TCK = os.sysconf("SC_CLK_TCK")


def _split(stat: str) -> tuple[str, list[str]]:
    return stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()


def cpu_ticks(pid: int) -> tuple[int, int, int, int]:
    """(utime, stime, cutime, cstime) of `pid`: itself and its reaped children, in ticks."""
    f = _split(Path(f"/proc/{pid}/stat").read_text())[1]
    ut, st, cut, cst = (int(x) for x in f[11:15])
    return ut, st, cut, cst


def processes() -> Iterator[tuple[int, str, int, int]]:
    """(pid, comm, ppid, utime+stime ticks) of every live process (one gone meanwhile is left out)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm, f = _split((d / "stat").read_text())
        except OSError:
            continue
        yield int(d.name), comm, int(f[1]), int(f[11]) + int(f[12])
