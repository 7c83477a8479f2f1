"""favordynmods (D92): scripts/host-setup.sh remounts the cgroup v2 hierarchy with it, keeping the
mount's other options, so that crun's cgroup.procs writes (one per hierarchy per sandbox start) no
longer wait an RCU grace period for the host-wide lock; sandboxes start and are confined as before.

The switch cannot be turned off again on this kernel (6.18 leaves it half switched), so no test
turns it off: the start without it is what every test ran on before host-setup turned it on."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from dsec.backends.container import cgroups
from conftest import requires_root

ROOT = Path(__file__).resolve().parents[1]


def _has_feature() -> bool:
    try:
        return "favordynmods" in cgroups.FEATURES.read_text().split()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _has_feature(), reason="this kernel has no cgroup favordynmods (< 6.1)")


def _v2_options() -> list[str]:
    return cgroups.cgroup_mount_options(cgroups.MOUNTINFO.read_text()).get(str(cgroups.v2_root()), [])


def test_host_setup_turns_it_on_and_keeps_the_mounts_options():
    requires_root()
    if not cgroups.v2_root().joinpath("cgroup.controllers").exists():
        pytest.skip("no cgroup v2 hierarchy to carry the option")
    before = _v2_options()
    for _ in range(2):                      # idempotent: the second run changes nothing
        r = subprocess.run(["bash", str(ROOT / "scripts" / "host-setup.sh")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "favordynmods" not in r.stderr, r.stderr
        after = _v2_options()
        assert "favordynmods" in after, after
        assert set(before) - {"favordynmods"} <= set(after), (before, after)
    assert cgroups.favors_dynmods() and cgroups.dynmods_problem() is None


def _attach_ms(gap_s: float, n: int) -> float:
    """p50 of the cgroup.procs writes of one fresh process into every v1/v2 hierarchy, gap_s apart
    (what crun does per start); the directories are made before the clock, removed after."""
    root = cgroups.CGROUP_ROOT
    hier = [root] if cgroups.is_unified() else [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()]
    out = []
    for i in range(n):
        time.sleep(gap_s)
        dirs = [h / f"dsec-test-attach-{os.getpid()}-{i}" for h in hier]
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        try:
            for d in dirs:
                d.mkdir()
                if d.parent.name == "cpuset":
                    for k in ("cpuset.cpus", "cpuset.mems"):
                        (d / k).write_text((d.parent / k).read_text())
            t = time.perf_counter()
            for d in dirs:
                (d / "cgroup.procs").write_text(str(pid))
            out.append((time.perf_counter() - t) * 1000)
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            for d in dirs:
                if d.exists():
                    d.rmdir()
    return statistics.median(out)


def test_a_starts_cgroup_writes_do_not_wait_for_a_grace_period():
    """Without favordynmods the first cgroup.procs write after a quiet spell waits an RCU grace
    period (10-23 ms on this box, every lone start); with it all of them take microseconds."""
    requires_root()
    if not cgroups.favors_dynmods():
        subprocess.run(["bash", str(ROOT / "scripts" / "host-setup.sh")], check=True, capture_output=True)
    ms = _attach_ms(0.05, 9)
    assert ms < 5.0, f"cgroup.procs writes of one start took {ms:.1f} ms (p50): still waiting for the lock"


async def test_a_sandbox_starts_and_is_confined_with_it_on(client):
    """(A mount of cgroup2 in the host's cgroup namespace re-applies the root's options: raw
    `crun run` of `crun spec`'s default config, which mounts /sys/fs/cgroup, clears the flag on the
    mount while 6.18 keeps the per-process lock; so the flag is set again here, not asserted.)"""
    requires_root()
    subprocess.run(["bash", str(ROOT / "scripts" / "host-setup.sh")], check=True, capture_output=True)
    async with await client.create_container(image="debian-python") as sb:
        r = await sb.run("cat /proc/self/cgroup; echo x > /proc/sys/kernel/hostname; echo rc=$?")
        assert f"/{sb.id}" in r.stdout, r.stdout           # in its own cgroups
        assert "rc=0" not in r.stdout, r.stdout            # /proc/sys still read-only
