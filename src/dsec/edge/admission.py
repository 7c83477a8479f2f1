"""Final admission check on the node: reject when full, with the resource that is short.

Limits are commitments, not reservations: agents idle most of the time (the reference saw 90%
of sandboxes use <=5% of the CPU they ask for), so CPU and memory limits are overcommitted by
configurable factors, and real free memory is checked on top.

Disk is not overcommitted past what is really free: a new sandbox is refused while DSEC_HOME's
filesystem (layer store, records, VM disks, the scratch image's growth) or the sandboxes'
scratch filesystem (their writable layers) has less free than its reserve, or is read-only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dsec.types import CapacityExceeded, NodeCapacity, NodeStatus, Unavailable


def _meminfo_mb(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024
    return 0


class StorageLow(Unavailable):
    """A filesystem of the node is (nearly) full or read-only: 503, naming it; the node takes
    no sandbox until space is freed."""


@dataclass(frozen=True)
class DiskReserve:
    """Free space a filesystem must keep for admission to let a new sandbox in."""

    what: str              # how messages name it
    path: Path
    reserve_mb: int
    setting: str           # the environment variable that sets reserve_mb
    separate_mount: bool = False   # only checked while `path` is a mount point of its own

    def problem(self) -> str | None:
        if self.separate_mount and not os.path.ismount(self.path):
            return None
        try:
            st = os.statvfs(self.path)
        except FileNotFoundError:
            return None
        if st.f_flag & os.ST_RDONLY:
            return (f"{self.what} ({self.path}) is read-only (a filesystem goes read-only after an I/O "
                    f"error: see dmesg; stop dsec, `umount {self.path}`, free space under it, start again)")
        free = st.f_bavail * st.f_frsize >> 20
        if free < self.reserve_mb:
            return (f"{self.what} ({self.path}) has {free} MiB free, below its reserve of "
                    f"{self.reserve_mb} MiB ({self.setting})")
        return None


@dataclass
class Admission:
    capacity: NodeCapacity
    mem_reserve_mb: int = 512
    disks: tuple[DiskReserve, ...] = ()

    @classmethod
    def for_this_host(cls, home: Path | None = None) -> "Admission":
        env = os.environ
        cpu = (os.cpu_count() or 1) * float(env.get("DSEC_CPU_OVERCOMMIT", "16"))
        mem = int(_meminfo_mb("MemTotal") * float(env.get("DSEC_MEM_OVERCOMMIT", "8")))
        disks: tuple[DiskReserve, ...] = ()
        if home is not None:
            disks = (DiskReserve("the DSEC_HOME filesystem", home, int(env.get("DSEC_HOME_RESERVE_MB", "1024")),
                                 "DSEC_HOME_RESERVE_MB"),
                     DiskReserve("the sandboxes' scratch filesystem", home / "sb",
                                 int(env.get("DSEC_SCRATCH_RESERVE_MB", "256")), "DSEC_SCRATCH_RESERVE_MB",
                                 separate_mount=True))
        return cls(NodeCapacity(cpu_cores=cpu, memory_mb=mem,
                                max_sandboxes=int(env.get("DSEC_MAX_SANDBOXES", "4000"))),
                   mem_reserve_mb=int(env.get("DSEC_MEM_RESERVE_MB", "512")), disks=disks)

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
        for disk in self.disks:
            problem = disk.problem()
            if problem:
                raise StorageLow(f"node {status.node_id} cannot take a sandbox: {problem}",
                                 fix="free space there (stop sandboxes, `dsec image rm` unused images, remove "
                                     f"other files), or place the sandbox on another node; or lower {disk.setting}")
