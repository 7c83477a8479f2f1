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


def v1_dir(controller: str, rel: str) -> Path:
    """A sandbox's directory in a cgroup v1 hierarchy (memory, freezer, ...)."""
    return CGROUP_ROOT / controller / rel.lstrip("/")
