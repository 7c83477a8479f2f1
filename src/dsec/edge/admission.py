"""Final admission check on the node: reject when full, with the resource that is short.

Limits are commitments, not reservations: agents idle most of the time (the reference saw 90%
of sandboxes use <=5% of the CPU they ask for), so CPU and memory limits are overcommitted by
configurable factors, and real free memory is checked on top.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dsec.types import CapacityExceeded, NodeCapacity, NodeStatus


def _meminfo_mb(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024
    return 0


@dataclass
class Admission:
    capacity: NodeCapacity
    mem_reserve_mb: int = 512

    @classmethod
    def for_this_host(cls) -> "Admission":
        env = os.environ
        cpu = (os.cpu_count() or 1) * float(env.get("DSEC_CPU_OVERCOMMIT", "16"))
        mem = int(_meminfo_mb("MemTotal") * float(env.get("DSEC_MEM_OVERCOMMIT", "8")))
        return cls(NodeCapacity(cpu_cores=cpu, memory_mb=mem,
                                max_sandboxes=int(env.get("DSEC_MAX_SANDBOXES", "4000"))),
                   mem_reserve_mb=int(env.get("DSEC_MEM_RESERVE_MB", "512")))

    def host_problem(self) -> str | None:
        avail = _meminfo_mb("MemAvailable")
        if avail < self.mem_reserve_mb:
            return f"node memory low: {avail} MiB available, reserve is {self.mem_reserve_mb} MiB"
        return None

    def admit(self, status: NodeStatus, cpu_cores: float, memory_mb: int) -> None:
        c = self.capacity
        fix = "retry later, stop idle sandboxes, or ask for smaller limits"
        if status.sandboxes + 1 > c.max_sandboxes:
            raise CapacityExceeded(f"node {status.node_id} is full: {status.sandboxes}/{c.max_sandboxes} sandboxes",
                                   fix=fix)
        if status.committed_memory_mb + memory_mb > c.memory_mb:
            raise CapacityExceeded(f"node {status.node_id} is full: memory committed "
                                   f"{status.committed_memory_mb}+{memory_mb} > {c.memory_mb} MiB",
                                   field="memory_mb", fix=fix)
        if status.committed_cpu_cores + cpu_cores > c.cpu_cores:
            raise CapacityExceeded(f"node {status.node_id} is full: cpu committed "
                                   f"{status.committed_cpu_cores:g}+{cpu_cores:g} > {c.cpu_cores:g} cores",
                                   field="cpu_cores", fix=fix)
        problem = self.host_problem()
        if problem:
            raise CapacityExceeded(problem, fix=fix)
