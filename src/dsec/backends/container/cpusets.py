"""Which host CPUs a container sandbox may run on (its cpuset): ceil(cpu_cores) of them, the
least loaded, so that nproc and sched_getaffinity say the sandbox's size and sandboxes spread
over the node (D50). Load is the sum of the cores of the sandboxes placed on a CPU (a 1.5-core
sandbox on 2 CPUs adds 0.75 to each); fractional cores count as one CPU.
"""

from __future__ import annotations

import math
import os


def cpu_count_for(cores: float, host_cpus: int) -> int:
    """CPUs in the cpuset of a sandbox of `cores`: ceil, at least 1, at most the host's."""
    return max(1, min(host_cpus, math.ceil(cores - 1e-9)))


def to_list(cpus: list[int]) -> str:
    """The kernel's cpu list format for cpuset.cpus ("0,2,3")."""
    return ",".join(str(c) for c in sorted(cpus))


def parse_list(text: str) -> list[int]:
    """ "0-2,5" -> [0, 1, 2, 5] """
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


class CpuSets:
    """Per-CPU load of this node's sandboxes; picks are O(CPUs log CPUs), never O(sandboxes)."""

    def __init__(self, cpus: list[int] | None = None):
        self.load = {c: 0.0 for c in sorted(cpus if cpus is not None else os.sched_getaffinity(0))}
        self.held: dict[str, tuple[list[int], float]] = {}

    def pick(self, sandbox_id: str, cores: float) -> str:
        """Place a sandbox (again: its old place is given up first); returns its cpu list."""
        self.release(sandbox_id)
        n = cpu_count_for(cores, len(self.load))
        chosen = sorted(sorted(self.load, key=lambda c: (self.load[c], c))[:n])
        self._add(sandbox_id, chosen, cores)
        return to_list(chosen)

    def adopt(self, sandbox_id: str, cpus: str, cores: float) -> None:
        """Count a sandbox placed before (an edge restart, a start after a park to disk)."""
        self.release(sandbox_id)
        chosen = [c for c in parse_list(cpus) if c in self.load]
        if chosen:
            self._add(sandbox_id, chosen, cores)

    def release(self, sandbox_id: str) -> None:
        held = self.held.pop(sandbox_id, None)
        if held is not None:
            cpus, cores = held
            for c in cpus:
                self.load[c] = max(0.0, self.load[c] - cores / len(cpus))

    def _add(self, sandbox_id: str, cpus: list[int], cores: float) -> None:
        self.held[sandbox_id] = (cpus, cores)
        for c in cpus:
            self.load[c] += cores / len(cpus)
