"""Final admission check on the node: reject when full, naming the resource that is short.

A sandbox is admitted by what the node measurably has left, not by the sum of what sandboxes
asked for: agents idle most of the time (the reference saw 90% of sandboxes use <=5% of the CPU
they ask for), so 3,200 one-core sandboxes on a 2-core node are normal. In order:

1. count: fewer than DSEC_MAX_SANDBOXES (4000) live sandboxes;
2. ceilings on committed requests (limits), only to stop absurd overcommit:
   cores x DSEC_CPU_OVERCOMMIT (2000) and MemTotal x DSEC_MEM_OVERCOMMIT (256). The defaults are
   chosen so the count binds first for default-size sandboxes (1 core, 512 MiB) on the smallest
   node we plan for, 2 cores / 8 GiB: 4000 x 1 core = 2 x 2000, 4000 x 512 MiB = 8 GiB x 250
   (3,200 of them fit down to 6.25 GiB of MemTotal). Bigger requests hit the ceiling sooner;
3. measured pressure, over the last ~10 s (PSI avg10, see pressure.py), below its limit:
   cpu some: off by default (DSEC_ADMIT_PSI_CPU_SOME=100). CPU is compressible (contention
   slows sandboxes, it does not break them), and PSI cpu `some` counts tasks throttled by their
   own CFS quota: 900 idle sandboxes at cpu_cores=0.005 read 74% while the CPUs were 76-81% idle
   (`dsec bench density`, docs/benchmarks.md), so a node full of tiny-quota sandboxes refused
   creations on an idle box. Set it (e.g. 90) where sandboxes have whole cores. Memory some 20% and full 10%
   (DSEC_ADMIT_PSI_MEMORY_SOME/_FULL: reclaim and swap-in stalls; full 10% is thrashing, while
   ~6% was seen here during swap-ins of parked sandboxes with 22 GiB free), io full 20%
   (DSEC_ADMIT_PSI_IO_FULL: everything waits for the disk; `io some` is left out, one
   fsync-heavy writer keeps it high). A limit of
   100 turns its check off; a kernel without PSI skips it (said once in the log);
4. MemAvailable above DSEC_MEM_RESERVE_MB (512) plus what a new sandbox needs resident at first,
   DSEC_ADMIT_SANDBOX_MB (8; an idle container is a few MiB: its limit is not what it uses).
   Short of it, the edge first waits (DSEC_ADMIT_RECLAIM_WAIT_S) for idle reclaim to give some
   back (reclaim.py `squeeze`, D95): refused at once only when nothing idle is left to reclaim;
5. disk: not overcommitted past what is really free: refused while DSEC_HOME's filesystem
   (layer store, records, VM disks, the scratch image's growth) or the sandboxes' scratch
   filesystem (their writable layers) has less free than its reserve, or is read-only.

The base of the ceilings is this edge's share of the host (node_share.py: its cgroup's limits,
DSEC_NODE_SHARE, DSEC_NODE_CPU_CORES / DSEC_NODE_MEMORY_MB), not always the whole host: several
edges on one host must not each admit up to all of it.

A refusal is CapacityExceeded (429; placement tries another node) naming the resource, the
measured value, the limit and the variable that sets it; disk is StorageLow (503). `resume` of
a parked sandbox goes through the same check. Each check is O(1) in the number of sandboxes,
and /proc is read at most once a second.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dsec.edge.node_share import CgroupLimits, cgroup_limits, node_share
from dsec.edge.pressure import HostProbe, Reading
from dsec.settings import AdmissionSettings, Settings
from dsec.types import CapacityExceeded, NodeCapacity, NodeStatus, Unavailable

CPU_OVERCOMMIT = 2000.0
MEM_OVERCOMMIT = 256.0
MAX_SANDBOXES = 4000
MEM_RESERVE_MB = 512
SANDBOX_MB = 8
PRESSURE_RETRY_AFTER_S = 5   # avg10 moves over seconds: retrying at once would see the same


class PressureHigh(CapacityExceeded):
    """The node is measurably short (stalls, free memory) right now: retry soon or elsewhere."""

    retry_after_s = PRESSURE_RETRY_AFTER_S


class MemoryShort(PressureHigh):
    """MemAvailable is below the reserve: what idle reclaim can give back (the edge waits for
    it a few seconds, edge/lifecycle.py) before this refusal stands. `claims_only`: MemAvailable
    itself suffices, only the claims of creates admitted a moment ago do not fit (admit_wait)."""

    def __init__(self, message: str, *, claims_only: bool = False, **kw: str | None):
        super().__init__(message, **kw)
        self.claims_only = claims_only


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
        # one statvfs, not cached: free space can drop by GiBs within a second of a burst
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


@dataclass(frozen=True)
class PsiLimit:
    """Refuse while `<resource> <kind> avg10` (percent of the last ~10 s stalled) reaches `limit`."""

    resource: str          # cpu | memory | io
    kind: str              # some | full
    limit: float
    setting: str           # the environment variable that sets limit
    request_field: str | None   # the request field of that resource, if any

    def ratio(self, reading: Reading) -> float:
        """How close the node is to this refusal: 0 idle, >= 1 refused."""
        value = reading.stall(self.resource, self.kind)
        return 0.0 if value is None or self.limit >= 100 else value / max(self.limit, 1e-9)


def psi_limits(s: AdmissionSettings) -> tuple[PsiLimit, ...]:
    def limit(resource: str, kind: str, fld: str | None) -> PsiLimit:
        setting = f"DSEC_ADMIT_PSI_{resource.upper()}_{kind.upper()}"
        return PsiLimit(resource, kind, getattr(s, f"psi_{resource}_{kind}"), setting, fld)
    return (limit("cpu", "some", "cpu_cores"), limit("memory", "some", "memory_mb"),
            limit("memory", "full", "memory_mb"), limit("io", "full", None))


@dataclass
class Admission:
    capacity: NodeCapacity             # the ceilings on committed requests, and the count
    mem_reserve_mb: int = MEM_RESERVE_MB
    disks: tuple[DiskReserve, ...] = ()
    psi: tuple[PsiLimit, ...] = ()     # none: pressure is not checked (tests, and nodes built by hand)
    sandbox_mb: int = 0                # resident memory a new sandbox needs at first
    probe: HostProbe = field(default_factory=HostProbe)
    # what the ceilings are multiples of, as refusals name it (node_share.py)
    cpu_basis: str = "cores"
    memory_basis: str = "MemTotal"

    @classmethod
    def for_this_host(cls, home: Path | None = None, probe: HostProbe | None = None,
                      cores: int | None = None, conf: Settings | None = None) -> Admission:
        conf = conf or Settings()
        s = conf.admission
        probe = probe or HostProbe()
        total_mb = probe.read().mem_total_mb or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
        # the cgroup this process runs in, read through the probe's /proc (a fake one has none)
        cgroup = cgroup_limits(probe.proc) if (probe.proc / "self").exists() else CgroupLimits()
        share = node_share(s, cores or os.cpu_count() or 1, total_mb, cgroup)
        cpu = share.cpu_cores * s.cpu_overcommit
        mem = int(share.memory_mb * s.mem_overcommit)
        disks: tuple[DiskReserve, ...] = ()
        if home is not None:
            disks = (DiskReserve("the DSEC_HOME filesystem", home, conf.storage.home_reserve_mb,
                                 "DSEC_HOME_RESERVE_MB"),
                     DiskReserve("the sandboxes' scratch filesystem", home / "sb",
                                 conf.storage.scratch_reserve_mb, "DSEC_SCRATCH_RESERVE_MB",
                                 separate_mount=True))
        return cls(NodeCapacity(cpu_cores=cpu, memory_mb=mem,
                                max_sandboxes=s.max_sandboxes,
                                node_cpu_cores=share.cpu_cores if share.explicit else None,
                                node_memory_mb=share.memory_mb if share.explicit else None),
                   mem_reserve_mb=s.mem_reserve_mb, disks=disks, psi=psi_limits(s), sandbox_mb=s.sandbox_mb,
                   probe=probe, cpu_basis=share.cpu_basis, memory_basis=share.memory_basis)

    # -- what the watcher sees ---------------------------------------------------------
    def host_problem(self) -> str | None:
        """Why the node cannot take any sandbox now (status() reports it unhealthy)."""
        avail = self.probe.read().mem_available_mb
        if avail is not None and avail < self.mem_reserve_mb:
            return (f"node memory low: {avail} MiB available, reserve is {self.mem_reserve_mb} MiB "
                    "(DSEC_MEM_RESERVE_MB)")
        return None

    def pressure(self) -> float:
        """The highest PSI reading relative to its limit (0 idle, >= 1 refusing): placement
        prefers the less pressed of the nodes it samples."""
        reading = self.probe.read()
        return round(max((p.ratio(reading) for p in self.psi), default=0.0), 3)

    # -- the check ---------------------------------------------------------------------
    def admit(self, status: NodeStatus, cpu_cores: float, memory_mb: int, claimed_mb: int = 0) -> None:
        """`claimed_mb`: memory of creates admitted a moment ago that MemAvailable does not show
        yet (admit_wait.Claims): counted as gone."""
        self._check_commitments(status, cpu_cores, memory_mb)
        reading = self.probe.read()
        self._check_pressure(status.node_id, reading)
        self._check_memory(status.node_id, reading, claimed_mb)
        for disk in self.disks:
            problem = disk.problem()
            if problem:
                raise StorageLow(f"node {status.node_id} cannot take a sandbox: {problem}",
                                 fix="free space there (stop sandboxes, `dsec image rm` unused images, remove "
                                     f"other files), or place the sandbox on another node; or lower {disk.setting}")

    def _check_commitments(self, status: NodeStatus, cpu_cores: float, memory_mb: int) -> None:
        c, node = self.capacity, status.node_id
        if status.sandboxes + 1 > c.max_sandboxes:
            raise CapacityExceeded(f"node {node} is full: {status.sandboxes}/{c.max_sandboxes} sandboxes "
                                   "(DSEC_MAX_SANDBOXES)",
                                   fix="stop idle sandboxes, place it on another node, or raise DSEC_MAX_SANDBOXES")
        if status.committed_memory_mb + memory_mb > c.memory_mb:
            raise CapacityExceeded(f"node {node} is full: memory limits committed {status.committed_memory_mb}"
                                   f"+{memory_mb} MiB > ceiling {c.memory_mb} MiB ({self.memory_basis} x "
                                   "DSEC_MEM_OVERCOMMIT)",
                                   field="memory_mb",
                                   fix="ask for a smaller memory_mb, stop idle sandboxes, place it on another node, "
                                       f"or raise {_setting(self.memory_basis, 'DSEC_NODE_MEMORY_MB')}"
                                       "DSEC_MEM_OVERCOMMIT (a ceiling on limits; real use is checked apart)")
        if status.committed_cpu_cores + cpu_cores > c.cpu_cores:
            raise CapacityExceeded(f"node {node} is full: cpu limits committed {status.committed_cpu_cores:g}"
                                   f"+{cpu_cores:g} > ceiling {c.cpu_cores:g} cores ({self.cpu_basis} x "
                                   "DSEC_CPU_OVERCOMMIT)",
                                   field="cpu_cores",
                                   fix="ask for fewer cpu_cores, stop idle sandboxes, place it on another node, "
                                       f"or raise {_setting(self.cpu_basis, 'DSEC_NODE_CPU_CORES')}"
                                       "DSEC_CPU_OVERCOMMIT (a ceiling on limits; real use is checked apart)")

    def _check_pressure(self, node: str, reading: Reading) -> None:
        for p in self.psi:
            if p.ratio(reading) >= 1:
                value = reading.stall(p.resource, p.kind)
                raise PressureHigh(
                    f"node {node} is under {p.resource} pressure: PSI {p.resource} {p.kind} avg10 "
                    f"{value:g}% >= limit {p.limit:g}% ({p.setting})", field=p.request_field,
                    fix=f"retry in {PRESSURE_RETRY_AFTER_S} s or on another node, stop busy sandboxes; "
                        f"or raise {p.setting} (100 turns the check off)")

    def _check_memory(self, node: str, reading: Reading, claimed_mb: int = 0) -> None:
        avail, need = reading.mem_available_mb, self.mem_reserve_mb + self.sandbox_mb
        if avail is not None and avail - claimed_mb < need:
            claimed = (f" ({claimed_mb} MiB of it claimed by creates admitted in the last seconds)"
                       if claimed_mb else "")
            raise MemoryShort(
                f"node {node} is short of memory: MemAvailable {avail} MiB{claimed} < reserve {self.mem_reserve_mb} "
                f"MiB (DSEC_MEM_RESERVE_MB) + {self.sandbox_mb} MiB a new sandbox needs (DSEC_ADMIT_SANDBOX_MB)",
                field="memory_mb",
                fix="stop or park idle sandboxes, place it on another node, or lower DSEC_MEM_RESERVE_MB",
                claims_only=avail >= need)


def _setting(basis: str, explicit: str) -> str:
    """The share's own setting when the ceiling's base is one ("X or " for a fix), else ""."""
    if basis.startswith(explicit):
        return f"{explicit} or "
    return "DSEC_NODE_SHARE or " if "DSEC_NODE_SHARE" in basis else ""
