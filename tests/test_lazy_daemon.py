"""A dead lazy-loading daemon (issue 28, item 3): its FUSE mount stays listed but every access
fails with ENOTCONN (107), and so do the layer mounts made from it. A create then restarts the
daemon and succeeds; were that impossible, it would be a 503 naming the node, never a 4xx.
Real server (DSEC_LAZY=1), real FUSE daemon killed with SIGKILL."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from dsec.config import Paths
from dsec.images import ImageService, LayerMounts, ensure_builtin
from dsec.images.lazy import LazyView
from dsec.types import Unavailable

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["/usr/bin/python3", "-c", "import pyfuse3"],
                                        capture_output=True).returncode != 0,
    reason="needs root and python3-pyfuse3")


async def _node_id(srv) -> str:
    async with srv.client() as c:
        return (await c.nodes())[0].node_id


def _runs(pid: int) -> bool:
    """Not gone, not a zombie (the server reaps its child only when it looks)."""
    try:
        return b"State:\tZ" not in Path(f"/proc/{pid}/status").read_bytes()
    except OSError:
        return False


def test_a_create_restarts_a_dead_lazy_daemon():
    from conftest import ServerProc, _cleanup_home

    home = Path(tempfile.mkdtemp(prefix="dsec-lazyd-", dir="/var/tmp"))
    try:
        paths = Paths(home)
        paths.ensure()
        ensure_builtin(ImageService(paths), "busybox")
        srv = ServerProc(home, env={"DSEC_LAZY": "1"})
        srv.start()
        view = LazyView(paths)
        try:
            async def run_one() -> str:
                async with srv.client() as c:
                    async with await c.create_container(image="busybox") as sb:
                        return (await sb.run("echo ok; ls /bin | wc -l")).stdout
            assert asyncio.run(run_one()).startswith("ok\n")
            assert view.is_mounted()
            pid = int((view.root / "pid").read_text())
            os.kill(pid, 9)
            deadline = time.monotonic() + 30
            while _runs(pid):
                assert time.monotonic() < deadline, "the killed daemon still runs"
                time.sleep(0.05)
            assert view.is_mounted()                  # listed, but dead:
            with pytest.raises(OSError) as e:
                os.listdir(view.mnt)
            assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)     # 107, or 103 on newer kernels
            # as after `dsec cluster down`: the layers are not mounted any more, the dead view is
            LayerMounts(paths).unmount_all()

            # the old code: the create failed as InvalidArgument (OSError 107) while the node looked healthy
            assert asyncio.run(run_one()).startswith("ok\n")
            new = int((view.root / "pid").read_text())
            assert new != pid and _runs(new) and os.listdir(view.mnt)

            # a daemon that cannot be started again: 503 naming the node, never a client error
            node = asyncio.run(_node_id(srv))
            log = view.root / "lazyfs.log"
            os.kill(new, 9)
            while _runs(new):
                assert time.monotonic() < deadline + 30, "the killed daemon still runs"
                time.sleep(0.05)
            LayerMounts(paths).unmount_all()
            log.unlink()
            log.mkdir()                                 # the daemon's log cannot be opened
            with pytest.raises(Unavailable) as e503:
                asyncio.run(run_one())
            assert f"node {node}" in e503.value.message and "lazy layer view" in e503.value.message
            assert e503.value.fix
            log.rmdir()
            assert asyncio.run(run_one()).startswith("ok\n")
        finally:
            srv.kill()
    finally:
        LayerMounts(Paths(home)).unmount_all()
        LazyView(Paths(home)).stop()
        _cleanup_home(home)
