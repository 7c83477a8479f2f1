"""A create must not cost O(live sandboxes) in the kernel's cpuset code (issue 29 item 1, D90).

crun writes a new v1 cpuset's CPUs twice; a CPU change of a cpuset with sched_load_balance 1
(what the kernel gives a new one) rebuilds the scheduler domains, walking every cpuset of the
host. The driver makes the sandbox's cpuset first, with the flag off, so those writes rebuild
nothing. Asserted on the flag the kernel decides by (the count of walks is not exposed), and on
what the sandbox still sees: its own CPU, through a start, a park to disk and its resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.backends.container import cgroups
from dsec.backends.container.hibernate import on_disk
from dsec.backends.container.spec import cgroup_path

# found here, not by the driver's helper, so that the test also runs (and fails) on the old code
_V1 = cgroups.CGROUP_ROOT / "cpuset"
ROOT: Path | None = None if cgroups.is_unified() or not (_V1 / "cpuset.sched_load_balance").exists() else _V1
pytestmark = pytest.mark.skipif(ROOT is None, reason="no cgroup v1 cpuset hierarchy on this host")


def _cpuset(sid: str):
    assert ROOT is not None
    return ROOT / cgroup_path(sid).lstrip("/")


def _balanced_and_cpus(sid: str) -> tuple[str, str]:
    d = _cpuset(sid)
    return (d / "cpuset.sched_load_balance").read_text().strip(), (d / "cpuset.cpus").read_text().strip()


async def test_sandbox_cpuset_is_made_without_balancing(client, server):
    sb = await client.create_container(image="debian-python", cpu_cores=1, memory_mb=256)
    run = server.paths.sandboxes / sb.id / "run"
    try:
        flag, cpus = _balanced_and_cpus(sb.id)
        # main: "1" (the kernel's default), so each of crun's two cpus writes rebuilt the domains
        assert flag == "0", (flag, cpus)
        assert cpus.isdigit(), cpus            # one CPU picked, as before (DSEC_CPUSET)
        r = await sb.run("nproc")
        assert r.stdout.strip() == "1", r
        await sb.suspend()                     # quiescent: parked to disk, its cgroups removed
        assert on_disk(run)
        assert not _cpuset(sb.id).exists()
        await sb.resume()                      # started again by _start_again
        flag, cpus = _balanced_and_cpus(sb.id)
        assert flag == "0" and cpus.isdigit(), (flag, cpus)
        assert (await sb.run("nproc")).stdout.strip() == "1"
    finally:
        await sb.stop()
    assert not _cpuset(sb.id).exists()         # destroy still removes the directory it made


def test_the_driver_finds_the_same_hierarchy():
    assert cgroups.cpuset_v1_root() == ROOT


def test_precreate_keeps_an_existing_directory(tmp_path):
    """An existing directory (a leftover, a start again) gets the flag, nothing else."""
    root = tmp_path / "cpuset"
    d = root / "dsec" / "sb-x"
    d.mkdir(parents=True)
    (d / "cpuset.sched_load_balance").write_text("1")
    (d / "keep").write_text("k")
    cgroups.precreate_cpuset_v1(root, "/dsec/sb-x")
    assert (d / "cpuset.sched_load_balance").read_text() == "0" and (d / "keep").read_text() == "k"
