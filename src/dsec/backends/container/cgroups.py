"""Which cgroup layout this host has, and the checks crun needs before it can run."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def is_unified() -> bool:
    """Pure cgroup v2 (production hosts) vs v1/hybrid (these dev machines)."""
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def check_host() -> str | None:
    """Return an actionable problem description, or None when crun can run here."""
    if is_unified():
        return None
    unified = CGROUP_ROOT / "unified" / "cgroup.controllers"
    if unified.exists() and "hugetlb" in unified.read_text().split():
        return ("cgroup v2 at /sys/fs/cgroup/unified holds the hugetlb controller and crun "
                "refuses this hybrid mode; fix: mkdir -p /sys/fs/cgroup/hugetlb && "
                "mount -t cgroup -o hugetlb cgroup /sys/fs/cgroup/hugetlb (scripts/host-setup.sh does it)")
    if not (CGROUP_ROOT / "memory").is_dir():
        return "no cgroup memory controller mounted at /sys/fs/cgroup/memory"
    return None


def leftover_dirs(rel: str) -> list[Path]:
    """cgroup directories of a sandbox that still exist (should be none after destroy)."""
    roots = [CGROUP_ROOT] if is_unified() else [p for p in CGROUP_ROOT.iterdir() if p.is_dir()]
    return [r / rel.lstrip("/") for r in roots if (r / rel.lstrip("/")).exists()]


def v2_root() -> Path:
    """Where the cgroup v2 hierarchy is mounted (pure v2: the root; hybrid: .../unified)."""
    return CGROUP_ROOT if is_unified() else CGROUP_ROOT / "unified"


def v2_dir(rel: str) -> Path:
    """The cgroup v2 directory of a sandbox: cgroup-BPF programs attach here (both layouts)."""
    return v2_root() / rel.lstrip("/")


def oom_kills(rel: str) -> int | None:
    """How many processes the kernel's OOM killer has killed in a sandbox's memory cgroup
    (v2 memory.events, v1 memory.oom_control; kernels >= 4.13), None if unknown."""
    f = (v2_root() / rel.lstrip("/") / "memory.events") if is_unified() else \
        (CGROUP_ROOT / "memory" / rel.lstrip("/") / "memory.oom_control")
    try:
        for line in f.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _counters(f: Path) -> dict[str, int]:
    """'key value' lines of a cgroup file (memory.events, memory.oom_control); {} if unreadable."""
    out: dict[str, int] = {}
    try:
        for line in f.read_text().splitlines():
            key, _, value = line.partition(" ")
            out[key] = int(value)
    except (OSError, ValueError):
        pass
    return out


def _read_int(f: Path) -> int | None:
    try:
        return int(f.read_text())
    except (OSError, ValueError):
        return None


def oom_from_above(rel: str) -> bool:
    """Whether the OOM kills in a sandbox's memory cgroup came from above it (the host ran out,
    or an ancestor cgroup's limit: the node's sandboxes parent) rather than from its own limit.

    v2: memory.events `oom` counts the times this cgroup (or one below it) hit its own limit
    and invoked the OOM killer; an ancestor's or the host's OOM is counted there, not here, while
    `oom_kill` counts the kills of this cgroup's tasks from any source. So kills with `oom` 0 came
    from above. v1 has no `oom` count, and memory.failcnt stays 0 on this kernel (6.18: measured,
    an own-limit OOM kill left it 0); but an own-limit OOM needs the usage to reach the limit, so
    the high-water mark (memory.max_usage_in_bytes, and the memsw pair with swap accounting)
    below its limit by more than OWN_LIMIT_SLACK means the kill came from above. A sandbox that
    once came near its own limit and was later killed from above counts as its own (oom_killed):
    the conservative side. A sandbox cannot reset these: its cgroup files are read-only inside."""
    if is_unified():
        ev = _counters(v2_root() / rel.lstrip("/") / "memory.events")
        return ev.get("oom_kill", 0) > 0 and ev.get("oom", 1) == 0
    d = CGROUP_ROOT / "memory" / rel.lstrip("/")
    if _counters(d / "memory.oom_control").get("oom_kill", 0) <= 0:
        return False
    for prefix in ("memory.", "memory.memsw."):
        limit, peak = _read_int(d / f"{prefix}limit_in_bytes"), _read_int(d / f"{prefix}max_usage_in_bytes")
        if prefix == "memory." and (limit is None or peak is None):
            return False                           # unknown: not claimed as the host's doing
        if limit is not None and peak is not None and peak >= limit - OWN_LIMIT_SLACK:
            return False                           # it reached its own limit
    return True


# How far below its limit a cgroup's high-water mark may stop when the limit itself refused a
# charge (charges come in batches of up to 64 pages; a failed batch falls back to single pages)
OWN_LIMIT_SLACK = 1 << 20


def v1_dir(controller: str, rel: str) -> Path:
    """A sandbox's directory in a cgroup v1 hierarchy (memory, freezer, ...)."""
    return CGROUP_ROOT / controller / rel.lstrip("/")


def cpuset_v1_root() -> Path | None:
    """The cgroup v1 cpuset hierarchy's mountpoint, None on pure v2 or without one."""
    if is_unified():
        return None
    root = CGROUP_ROOT / "cpuset"
    return root if (root / "cpuset.sched_load_balance").exists() else None


def precreate_cpuset_v1(root: Path, rel: str) -> None:
    """Make a sandbox's v1 cpuset before crun does, with sched_load_balance 0 (issue 29, D90).

    Why: a v1 cpuset is born with sched_load_balance 1 and empty CPUs, and crun then writes its
    cpuset.cpus twice (the parent's CPUs, then the sandbox's pick). A CPU change of a balancing
    cpuset makes the kernel rebuild the scheduler domains, which walks *every* cpuset on the host:
    O(live sandboxes) per create (0.28 -> 0.70 ms per create's cpuset writes at 2,500 siblings).
    With the flag off first (free while the CPUs are still empty) the writes rebuild nothing.
    Scheduling is unchanged: while the root cpuset balances (the default), the kernel balances
    over all CPUs and a child's flag is ignored (cgroup-v1/cpusets.rst, 1.7). crun takes the
    existing directory as it is; destroy's rmdir in every hierarchy removes it as before."""
    d = root / rel.lstrip("/")
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpuset.sched_load_balance").write_text("0")
    except OSError:
        pass   # only a cost: crun makes the directory (or reports why it cannot) as before


# favordynmods (kernel >= 6.1; 6.18: a per-process rwsem for cgroup.procs writes, D92). Without it
# every cgroup.procs write takes the host-wide cgroup_threadgroup_rwsem for writing: the first
# after a quiet spell waits an RCU grace period (10-23 ms measured here, once per create, raw crun
# alike) and each one stalls every fork/exec/exit on the host meanwhile. Turned on by
# scripts/host-setup.sh (one mount has it: the switch is host-wide); never turned off again (on
# 6.18 turning it off leaves the kernel half switched, fixed upstream in 2026).
FEATURES = Path("/sys/kernel/cgroup/features")
MOUNTINFO = Path("/proc/self/mountinfo")


def cgroup_mount_options(mountinfo: str) -> dict[str, list[str]]:
    """mountpoint -> super options of each cgroup/cgroup2 mount in a mountinfo text."""
    out: dict[str, list[str]] = {}
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        f, t = head.split(), tail.split()
        if sep and len(f) >= 5 and len(t) >= 3 and t[0] in ("cgroup", "cgroup2"):
            out[f[4]] = t[2].split(",")
    return out


def favors_dynmods(mountinfo: str | None = None) -> bool:
    """Whether any cgroup hierarchy is mounted with favordynmods (the switch is host-wide)."""
    text = MOUNTINFO.read_text() if mountinfo is None else mountinfo
    return any("favordynmods" in opts for opts in cgroup_mount_options(text).values())


def dynmods_problem(features: str | None = None, mountinfo: str | None = None) -> str | None:
    """A warning for a kernel that has favordynmods while no hierarchy has it on; None if on or
    the kernel lacks it (then every create waits as before: slower, nothing else changes)."""
    if features is None:
        try:
            features = FEATURES.read_text()
        except OSError:
            return None
    if "favordynmods" not in features.split() or favors_dynmods(mountinfo):
        return None
    return ("no cgroup hierarchy is mounted with favordynmods: each sandbox start waits an RCU grace "
            "period (~10-20 ms) in its first cgroup.procs write and stalls the host's forks meanwhile")
