"""/proc/PID/stat: a process's state, parent and CPU time, read one way everywhere (the drivers,
the benches, benchmarks/procstat.py, the tests); and its threads' schedstat (cpu_ns).

Fields are counted after the command name (which may hold spaces and parentheses, so it is cut
at the last ')'): [0] is the state (field 3 in proc(5)), [1] the parent pid, [11:15] utime,
stime, cutime, cstime in clock ticks, [19] the start time; [N-3] is proc(5)'s field N.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

TCK = os.sysconf("SC_CLK_TCK")      # clock ticks a second


def split(stat: str) -> tuple[str, list[str]]:
    """(command name, the fields after it) of one /proc/PID/stat text."""
    return stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()


def fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name. Raises OSError once it is gone."""
    return split(Path(f"/proc/{pid}/stat").read_text())[1]


def cpu_ticks(pid: int) -> tuple[int, int, int, int]:
    """(utime, stime, cutime, cstime) of `pid`: itself and its reaped children, in ticks."""
    ut, st, cut, cst = (int(x) for x in fields(pid)[11:15])
    return ut, st, cut, cst


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` (all its threads; not its children)."""
    ut, st, _, _ = cpu_ticks(pid)
    return (ut + st) / TCK


def cpu_ns(pid: int) -> int:
    """CPU time of all of a process's threads, in ns (their schedstat: finer than the ticks of
    /proc/PID/stat, for a short window). Raises OSError once the process is gone."""
    total = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((t / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue      # a thread that ended meanwhile
    return total


def processes() -> Iterator[tuple[int, str, int, int]]:
    """(pid, comm, ppid, utime+stime ticks) of every live process (one gone meanwhile is left out)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm, f = split((d / "stat").read_text())
        except OSError:
            continue
        yield int(d.name), comm, int(f[1]), int(f[11]) + int(f[12])
