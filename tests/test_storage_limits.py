"""A node whose disk fills up, on real components: a DSEC_HOME on its own small ext4 (a loop
device made here), a `dsec up` on it, crun sandboxes writing into the btrfs scratch.

Before: the scratch image was sparse, so when the host filesystem filled, btrfs got EIO from
the loop device: a sandbox's `write; sync` returned 0 and the data was gone, the scratch went
read-only for every sandbox, creates answered a bare 500 and left `creating` records. Now the
scratch is allocated on the host (never sparse), admission keeps reserves on both
filesystems (503 naming the one that is short), and a full scratch is ENOSPC for its writer.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ServerProc, _cleanup_home, link_downloads, requires_root
from dsec.config import Paths
from dsec.types import DsecError, SandboxState

MIB = 1 << 20


def _mounts_under(p: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(p))]


@pytest.fixture
def small_home() -> Iterator[Path]:
    """DSEC_HOME on a 3 GiB ext4 of its own (loop-mounted), busybox built into it; afterwards
    no mount, loop device or file of it is left."""
    requires_root()
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService

    base = Path(tempfile.mkdtemp(prefix="dsec-small-", dir="/var/tmp"))
    img, home = base / "home.ext4", base / "home"
    home.mkdir()
    with open(img, "wb") as f:
        f.truncate(3 << 30)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(home)], check=True)
    try:
        link_downloads(home)
        Paths(home).ensure()
        ensure_builtin(ImageService(Paths(home)), "busybox")
        yield home
    finally:
        _cleanup_home(home)                    # sandboxes, sb/ and home itself (lazily)
        for m in sorted(_mounts_under(base), key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        loops = subprocess.run(["losetup", "-j", str(img)], capture_output=True, text=True).stdout
        shutil.rmtree(base, ignore_errors=True)
        assert _mounts_under(base) == [], "a mount of the test home was left behind"
        assert loops.strip() == "" or all("(deleted)" in x for x in loops.splitlines()), loops


def _avail(p: Path) -> int:
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def _fill(path: Path) -> None:
    """Take every free block of path's filesystem (as a growing layer store or a neighbour would)."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\1" * (8 * MIB))
                f.flush()
        except OSError:
            pass
    try:
        os.sync()
    except OSError:
        pass


async def _creating(c) -> list:
    return [s for s in await c.list(include_ended=True) if s.state == SandboxState.creating]


async def test_a_full_home_refuses_new_sandboxes_and_loses_no_data(small_home: Path):
    home = small_home
    srv = ServerProc(home, env={"DSEC_SCRATCH_GB": "1.25", "DSEC_HOME_RESERVE_MB": "64",
                                "DSEC_SCRATCH_RESERVE_MB": "64"})
    srv.start()
    try:
        async with srv.client() as c:
            a = await c.create_container(image="busybox", user="root", disk_mb=8192)

            # the host filesystem fills up from outside the scratch
            _fill(home / "filler")
            r = await a.run("dd if=/dev/urandom of=/work/data bs=1M count=64 status=none && sync && md5sum /work/data")
            assert r.exit_code == 0, r      # the scratch's blocks were the scratch's: nothing to lose
            md5 = r.stdout.split()[0]
            r = await a.run("dd if=/work/data iflag=direct bs=1M status=none | md5sum")
            assert r.stdout.split()[0] == md5, r          # on disk, not only in the page cache

            with pytest.raises(DsecError) as e:
                await c.create_container(image="busybox")
            assert "HTTP 503" in str(e.value) or e.value.code == "unavailable", e.value
            assert "DSEC_HOME filesystem" in e.value.message and "DSEC_HOME_RESERVE_MB" in e.value.message
            assert e.value.fix
            assert await _creating(c) == []

            # room on the host again, but the scratch is at DSEC_SCRATCH_GB: its writers get
            # ENOSPC (never EIO), what they wrote before stays, new sandboxes are refused
            (home / "filler").unlink()
            r = await a.run("i=0; while fallocate -l 64M /work/fill$i 2>/dev/null; do i=$((i+1)); done; "
                            "dd if=/dev/zero of=/work/more bs=1M count=256 status=none; sync")
            assert "No space left on device" in r.stderr, r     # allocated fast, then written up to the end
            assert "Input/output error" not in r.stderr
            r = await a.run("dd if=/work/data iflag=direct bs=1M status=none | md5sum")
            assert r.stdout.split()[0] == md5, r
            with pytest.raises(DsecError) as e:
                await c.create_container(image="busybox")
            assert "scratch filesystem" in e.value.message and "DSEC_SCRATCH_RESERVE_MB" in e.value.message
            assert await _creating(c) == []

            # the scratch stayed writable: freeing space is enough (btrfs hands the emptied
            # block groups back to metadata at its next commits, within seconds)
            r = await a.run("rm /work/fill* /work/more && sync && for i in $(seq 40); do dd if=/dev/zero of=/work/again bs=1M "
                            "count=8 status=none 2>/dev/null && sync && echo ok && break; sleep 0.5; done")
            assert r.stdout == "ok\n", r
            assert "ro," not in subprocess.run(["findmnt", "-no", "OPTIONS", str(home / "sb")],
                                               capture_output=True, text=True).stdout
            b = await c.create_container(image="busybox")
            await b.stop()

        # a restart recovers the running sandbox with its data
        srv.kill()
        srv.start()
        async with srv.client() as c:
            a = await c.get(a.id)
            assert a.info.state == SandboxState.running
            r = await a.run("md5sum /work/data")
            assert r.stdout.split()[0] == md5
            await a.stop()
    finally:
        srv.kill(signal.SIGTERM)


async def test_the_scratch_is_allocated_on_the_host_and_grows_on_demand(small_home: Path):
    home = small_home
    img = home / "scratch.img"
    srv = ServerProc(home, env={"DSEC_SCRATCH_INITIAL_GB": "1", "DSEC_HOME_RESERVE_MB": "64",
                                "DSEC_SCRATCH_RESERVE_MB": "64"})
    srv.start()
    try:
        st = img.stat()
        assert st.st_size == 1 << 30
        assert st.st_blocks * 512 >= st.st_size, "the scratch image is sparse: it can outgrow the host"
        async with srv.client() as c:
            a = await c.create_container(image="busybox", user="root", disk_mb=8192)
            # more than the initial size, written in steps: the watcher grows it meanwhile
            for i in range(6):
                r = await a.run(f"fallocate -l 256M /work/f{i} && sync && echo ok")
                assert r.stdout == "ok\n", (i, r, img.stat().st_size >> 20)
                await asyncio.sleep(1.5)
            st = img.stat()
            assert st.st_size > 1 << 30 and st.st_blocks * 512 >= st.st_size
            # never past what keeps 2 x the home reserve free on the host
            assert _avail(home) >= 2 * 64 * MIB - 16 * MIB
            await a.stop()
    finally:
        srv.kill(signal.SIGTERM)
