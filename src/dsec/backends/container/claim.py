"""Warm-pool claims of container sandboxes (dsec.backends.warm.WarmClaim): which settings a
running container cannot change (its pool key) and the cgroup writes that give a pre-started
container the claimer's limits.

Fixed at start, hence in the key: the image layers (the overlay), the agent's command line
(workdir, uid/gid, nofile, max_file_mb and the retained-output bound, a function of memory_mb),
the /dev/shm size (also of memory_mb), the writable layer's quota (disk_mb), the user namespace
and the CPU class (a batch sandbox's RLIMIT_NICE is in its config). Applied at claim: CPU quota
and weight, memory (and v1 memory+swap, socket buffer) limits, pids limit, the cpuset (cpusets.py),
as crun would have written them from config.json (spec.py); the network policy (network.py, as
set_network does). lxcfs reads the limits live, so a claimed sandbox's /proc/meminfo is its own.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

from dsec.backends.base import Prepared
from dsec.backends.container import cgroups, qos
from dsec.backends.container.qos import CPU_PERIOD_US, cpu_quota_us
from dsec.backends.container.spec import retained_output_bytes, tcp_mem_bytes
from dsec.types import ContainerArgs


def shm_bytes(memory_mb: int) -> int:
    """Size of the sandbox's /dev/shm tmpfs (spec.py's build_config)."""
    return min(memory_mb << 20, 256 << 20)


def warm_key(prepared: Prepared, userns: bool) -> Hashable | None:
    args = prepared.args
    if not isinstance(args, ContainerArgs) or args.secrets or args.snapshot is not None:
        # secrets: a CA bundle bound at start; a snapshot's files: never warm
        return None
    layers = tuple(layer.digest for layer in prepared.plan)
    return ("container", layers, prepared.uid, prepared.gid, args.workdir, args.nofile, args.max_file_mb,
            args.disk_mb, args.cpu_class, retained_output_bytes(args.memory_mb), shm_bytes(args.memory_mb), userns)


def shares_to_weight(shares: int) -> int:
    """crun's mapping of OCI cpu.shares to cgroup v2 cpu.weight (2..262144 -> 1..10000)."""
    return 1 + ((shares - 2) * 9999) // 262142


def _write(f: Path, value: int | str) -> None:
    f.write_text(str(value))


def apply_limits(rel: str, args: ContainerArgs, *, v2: bool, quota_floor: float = qos.DEFAULT_QUOTA_FLOOR_CORES,
                 cpus: str = "") -> None:
    """Write the claimer's CPU, memory and pids limits into the container's cgroups (blocking:
    run in a thread). Raises OSError if a limit cannot be set (e.g. memory below what the
    container holds: EBUSY), and the edge then destroys the container."""
    mem = args.memory_mb << 20
    quota = cpu_quota_us(args.cpu_cores, quota_floor)
    shares = qos.cpu_shares(args.cpu_class, args.cpu_cores)
    if v2:
        d = cgroups.v2_dir(rel)
        _write(d / "memory.max", mem)          # memory.swap.max stays 0: crun's swap == limit
        _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
        _write(d / "cpu.weight", shares_to_weight(shares))
        _write(d / "pids.max", args.pids_limit)
        if cpus:                               # the claimer's cpuset (cpusets.py)
            _write(d / "cpuset.cpus", cpus)
        return
    m = cgroups.v1_dir("memory", rel)
    memsw = m / "memory.memsw.limit_in_bytes"     # absent without swap accounting
    # memory.limit <= memory.memsw.limit at every step: raise memsw first, lower limit first
    order = [m / "memory.limit_in_bytes", memsw]
    if mem > int((m / "memory.limit_in_bytes").read_text()):
        order.reverse()
    for f in order:
        if f.exists():
            _write(f, mem)
    tcp = m / "memory.kmem.tcp.limit_in_bytes"
    if tcp.exists():
        _write(tcp, tcp_mem_bytes(args.memory_mb))
    cpu = cgroups.v1_dir("cpu", rel)
    _write(cpu / "cpu.cfs_period_us", CPU_PERIOD_US)
    _write(cpu / "cpu.cfs_quota_us", quota)
    _write(cpu / "cpu.shares", shares)
    _write(cgroups.v1_dir("pids", rel) / "pids.max", args.pids_limit)
    if cpus:
        _write(cgroups.v1_dir("cpuset", rel) / "cpuset.cpus", cpus)
