"""How much of the host one edge counts as its own: the base of its admission ceilings (D39).

By default an edge counts the whole host (os.cpu_count(), MemTotal). Several edges on one host
(a local multi-raylet cluster, an operator sharing a box) would then each admit up to the whole
host: overcommitted by the number of edges. The share, in order:

1. the host, bounded by the cgroup the edge runs in (cpu.max / memory.max of its own cgroup and
   its ancestors; cgroup v1: cpu.cfs_quota_us, memory.limit_in_bytes), so an edge started inside
   a limited container or systemd slice counts what it was given;
2. DSEC_NODE_SHARE: a fraction of that (`1/3` or `0.333`), what `dsec cluster up` gives each of
   the N edges it starts on one host;
3. DSEC_NODE_CPU_CORES / DSEC_NODE_MEMORY_MB: explicit amounts, which replace 1-2 for their
   resource (at most what 1 allows).

A bad value is InvalidArgument naming the variable and the fix: the edge does not start.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from dsec.settings import AdmissionSettings
from dsec.types import InvalidArgument

CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT_BYTES = 1 << 62        # cgroup v1 says "unlimited" as a huge page-rounded number


@dataclass(frozen=True)
class CgroupLimits:
    cpu_cores: float | None = None      # quota / period, the tightest on the way to the root
    memory_mb: int | None = None
    where: str = ""                     # the cgroup path, for messages


@dataclass(frozen=True)
class NodeShare:
    cpu_cores: float
    memory_mb: int
    cpu_basis: str          # how messages name where cpu_cores came from
    memory_basis: str
    explicit: bool = False  # anything but the whole host: NodeStatus reports it


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _upwards(mount: Path, cg_path: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount (namespace) root."""
    d = mount / cg_path.lstrip("/")
    out = [d]
    while d != mount and mount in d.parents:
        d = d.parent
        out.append(d)
    return out


def _cpu_v2(text: str | None) -> float | None:
    parts = (text or "").split()
    if len(parts) == 2 and parts[0] != "max":
        return int(parts[0]) / int(parts[1])
    return None


def _cpu_v1(d: Path) -> float | None:
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    if quota and period and int(quota) > 0:
        return int(quota) / int(period)
    return None


def _mem(text: str | None) -> int | None:
    if text and text != "max" and int(text) < NO_LIMIT_BYTES:
        return int(text) >> 20
    return None


def cgroup_limits(proc: Path = Path("/proc"), root: Path = CGROUP_ROOT) -> CgroupLimits:
    """The CPU and memory limits of the cgroup this process runs in (v2 or v1), None where
    there is none. Unreadable files count as no limit: this only ever tightens."""
    text = _read(proc / "self" / "cgroup")
    if not text:
        return CgroupLimits()
    cpus: list[float] = []
    mems: list[int] = []
    where = ""
    for line in text.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":       # v2: unified at the root, or at root/unified (hybrid)
            mount = root if (root / "cgroup.controllers").exists() else root / "unified"
            for d in _upwards(mount, path):
                cpus += [c for c in [_cpu_v2(_read(d / "cpu.max"))] if c]
                mems += [m for m in [_mem(_read(d / "memory.max"))] if m]
            where = where or path
        names = controllers.split(",")
        if "cpu" in names:
            mount = root / controllers if (root / controllers).is_dir() else root / "cpu"
            cpus += [c for d in _upwards(mount, path) for c in [_cpu_v1(d)] if c]
        if "memory" in names:
            mems += [m for d in _upwards(root / "memory", path) for m in [_mem(_read(d / "memory.limit_in_bytes"))] if m]
            where = path
    return CgroupLimits(min(cpus, default=None), min(mems, default=None), where)


def _fraction(raw: str) -> Fraction | None:
    raw = raw.strip()
    if not raw:
        return None
    try:
        value = Fraction(raw)
    except (ValueError, ZeroDivisionError):
        value = Fraction(-1)
    if not 0 < value <= 1:
        raise InvalidArgument(f"DSEC_NODE_SHARE={raw!r} is not a fraction of the host in (0, 1]",
                              field="DSEC_NODE_SHARE",
                              fix="set DSEC_NODE_SHARE to the part of this host the edge may use, e.g. 1/3 for one of three "
                                  "edges on the host (or 0.5); unset it for the whole host")
    return value


def _amount(raw: str, name: str, limit: float, limit_basis: str, unit: str,
            as_int: bool) -> float | None:
    raw = raw.strip()
    if not raw:
        return None
    try:
        value = float(raw)
        ok = value > 0 and (not as_int or value.is_integer())
    except ValueError:
        ok = False
    example = "4096" if as_int else "4 (or 0.5)"
    if not ok:
        raise InvalidArgument(f"{name}={raw!r} is not a positive {'whole ' if as_int else ''}number of {unit}",
                              field=name, fix=f"set {name} to the {unit} this edge may use, e.g. {example}; "
                                              "unset it for the whole host")
    if value > limit:
        raise InvalidArgument(f"{name}={raw} is more than this edge has: {limit:g} {unit} ({limit_basis})",
                              field=name, fix=f"set {name} to at most {limit:g}, or unset it")
    return value


def node_share(s: AdmissionSettings, host_cores: float, host_memory_mb: int,
               cgroup: CgroupLimits = CgroupLimits()) -> NodeShare:
    """This edge's CPU cores and memory (see the module doc)."""
    cores, cores_basis = float(host_cores), "cores"
    mem, mem_basis = int(host_memory_mb), "MemTotal"
    if cgroup.cpu_cores is not None and cgroup.cpu_cores < cores:
        cores, cores_basis = cgroup.cpu_cores, f"cpu.max of cgroup {cgroup.where or '/'}"
    if cgroup.memory_mb is not None and cgroup.memory_mb < mem:
        mem, mem_basis = cgroup.memory_mb, f"memory.max of cgroup {cgroup.where or '/'}"
    explicit = cores_basis != "cores" or mem_basis != "MemTotal"
    share = _fraction(s.node_share)
    explicit_cores = _amount(s.node_cpu_cores, "DSEC_NODE_CPU_CORES", cores, cores_basis, "CPU cores", as_int=False)
    explicit_mem = _amount(s.node_memory_mb, "DSEC_NODE_MEMORY_MB", mem, mem_basis, "MiB", as_int=True)
    if share is not None and share != 1:
        cores, cores_basis = cores * float(share), f"{share} of {cores_basis} (DSEC_NODE_SHARE)"
        mem, mem_basis = int(mem * share), f"{share} of {mem_basis} (DSEC_NODE_SHARE)"
        explicit = True
    if explicit_cores is not None:
        cores, cores_basis, explicit = explicit_cores, f"DSEC_NODE_CPU_CORES={explicit_cores:g}", True
    if explicit_mem is not None:
        mem, mem_basis, explicit = int(explicit_mem), f"DSEC_NODE_MEMORY_MB={int(explicit_mem)}", True
    return NodeShare(cores, mem, cores_basis, mem_basis, explicit)
