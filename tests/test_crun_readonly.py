"""crun from a read-only bind (D92, backends/container/crun_bin.py): host set-up binds the crun
binary read-only at /run/dsec/crun, crun started from there skips its per-command self-copy
(its CVE-2019-5736 guard: it only copies itself when its binary is writable), and the driver
uses the bind only while it is read-only and the same file as the crun it would run."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dsec.backends.container.crun_bin import RO_PATH, crun_binary
from conftest import requires_root

ROOT = Path(__file__).resolve().parents[1]
CRUN = shutil.which("crun")
pytestmark = pytest.mark.skipif(CRUN is None, reason="no crun on this host")


@contextlib.contextmanager
def _bind(src: str, dst: Path, ro: bool):
    dst.touch()
    subprocess.run(["mount", "--bind", src, str(dst)], check=True)
    try:
        if ro:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], check=True)
        yield dst
    finally:
        subprocess.run(["umount", str(dst)], check=True)


def test_the_driver_takes_the_bind_only_when_read_only_and_the_same_crun(tmp_path):
    requires_root()
    assert CRUN is not None
    assert crun_binary("crun", tmp_path / "absent") == CRUN
    with _bind(CRUN, tmp_path / "rw", ro=False) as p:
        assert crun_binary("crun", p) == CRUN                  # writable: crun would copy itself anyway
    with _bind(CRUN, tmp_path / "ro", ro=True) as p:
        assert crun_binary("crun", p) == str(p)
    with _bind(shutil.which("true") or "/bin/true", tmp_path / "other", ro=True) as p:
        assert crun_binary("crun", p) == CRUN                  # another file (a crun upgraded since)


def _execs(argv: list[str], tmp: Path) -> int:
    """execve/execveat calls of a crun command (its self-copy is a second exec)."""
    out = tmp / "trace"
    subprocess.run(["strace", "-f", "-qq", "-e", "trace=execve,execveat", "-o", str(out), *argv],
                   check=True, capture_output=True)
    return sum(1 for line in out.read_text().splitlines() if "execve" in line and "= 0" in line)


def test_host_setup_binds_crun_read_only_and_crun_then_runs_once(tmp_path):
    requires_root()
    for _ in range(2):                      # idempotent: one bind, not two
        r = subprocess.run(["bash", str(ROOT / "scripts" / "host-setup.sh")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                  if line.split()[4] == str(RO_PATH)]
        assert len(mounts) == 1 and "ro" in mounts[0].split()[5].split(","), mounts
    assert crun_binary() == str(RO_PATH)
    with pytest.raises(OSError) as e:       # not writable through the bind (what /proc/PID/exe resolves to)
        os.open(RO_PATH, os.O_WRONLY)
    assert e.value.errno in (errno.EROFS, errno.ETXTBSY), e.value
    if shutil.which("strace") is None:
        pytest.skip("no strace to count crun's execs")
    state = tmp_path / "state"
    assert _execs([CRUN, "--root", str(state), "list"], tmp_path) == 2     # crun copies itself, execs again
    assert _execs([str(RO_PATH), "--root", str(state), "list"], tmp_path) == 1


async def test_a_sandbox_starts_with_the_bind_and_cannot_see_it(client):
    requires_root()
    async with await client.create_container(image="debian-python", user="root") as sb:
        r = await sb.run("ls /run/dsec 2>&1; echo rc=$?; cat /proc/self/mountinfo")
        assert "rc=0" not in r.stdout, r.stdout        # the host's /run is not in the sandbox
        assert "/run/dsec/crun" not in r.stdout, r.stdout
