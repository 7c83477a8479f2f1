"""Upgrades in place (issue 28 item 7): a node running the previous release, with live and parked
sandboxes, is replaced by this code on the same home; every sandbox is adopted and answers.

The previous release is the git tag DSEC_UPGRADE_FROM (default v0.3.0; a commit works too),
exported from this checkout's git into a temp dir (`git archive`: nothing is left in the
repository if the test is killed) and run with PYTHONPATH pointing at it, sharing this venv.
The old code builds its own image into its own home, as an installed node would have. Skipped,
naming the tag, when the tag is absent (a shallow clone without tags).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from conftest import ServerProc, link_downloads, requires_root

from dsec.sdk.client import Client
from dsec.testing.isolated import cleanup_home

REPO = Path(__file__).resolve().parents[1]
FROM = os.environ.get("DSEC_UPGRADE_FROM", "v0.3.0")
NEW_SRC = Path(__import__("dsec").__file__).resolve().parents[1]     # the code under test
BUILD_BUSYBOX = ("from dsec.config import Paths; from dsec.images.builtin import ensure_builtin; "
                 "from dsec.images.service import ImageService; ensure_builtin(ImageService(Paths.from_env()), 'busybox')")


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True)


@pytest.fixture(scope="module")
def old_src():
    """The previous release's src/ in a temp dir."""
    requires_root()
    if not (REPO / ".git").exists() or _git("rev-parse", "-q", "--verify", f"{FROM}^{{commit}}").returncode != 0:
        pytest.skip(f"the previous release's git tag {FROM!r} is absent in {REPO}: `git fetch --tags`, "
                    "or DSEC_UPGRADE_FROM=<tag or commit>")
    out = Path(tempfile.mkdtemp(prefix="dsec-upgrade-src-", dir="/var/tmp"))
    try:
        tar = out / "src.tar"
        p = subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(tar), FROM, "src"], capture_output=True)
        assert p.returncode == 0, p.stderr.decode()
        with tarfile.open(tar) as t:
            t.extractall(out, filter="data")
        tar.unlink()
        assert (out / "src" / "dsec" / "__init__.py").exists()
        yield out / "src"
    finally:
        subprocess.run(["rm", "-rf", str(out)])


def _server(home: Path, src: Path) -> ServerProc:
    return ServerProc(home, env={"PYTHONPATH": str(src), "DSEC_VM": "0"})


async def test_a_node_of_the_previous_release_is_replaced_and_adopts_everything(old_src):
    home = Path(tempfile.mkdtemp(prefix="dsec-upgrade-", dir="/var/tmp"))
    home.chmod(0o711)
    link_downloads(home)
    old = new = None
    try:
        build = subprocess.run([sys.executable, "-c", BUILD_BUSYBOX], capture_output=True, text=True, timeout=600,
                               env={**os.environ, "DSEC_HOME": str(home), "PYTHONPATH": str(old_src)})
        assert build.returncode == 0, build.stderr[-2000:]
        old = _server(home, old_src)
        old.start(timeout_s=180)
        async with Client(old.url, old.key) as c:
            live = await c.create_container(image="busybox", memory_mb=64, cpu_cores=0.1, labels={"t": "upgrade"})
            parked = await c.create_container(image="busybox", memory_mb=64, cpu_cores=0.1, labels={"t": "upgrade"})
            await live.run("echo live > /tmp/mark && (sleep 3600 &) ")
            await parked.run("echo parked > /tmp/mark")
            assert (await parked.suspend()).state == "suspended"
        old.kill(signal.SIGTERM, timeout_s=120)      # `dsec down`: the sandboxes keep running
        assert old.proc is not None and old.proc.returncode == 0, old.log_tail()

        new = _server(home, NEW_SRC)
        new.start(timeout_s=180)
        async with Client(new.url, new.key) as c:
            listed = {s.id: s.state for s in await c.list()}
            assert listed.get(live.id) == "running" and listed.get(parked.id) == "suspended", listed
            sb = await c.get(live.id)
            assert (await sb.run("cat /tmp/mark")).stdout == "live\n"
            assert "sleep 3600" in (await sb.run("ps")).stdout          # its processes lived through it
            back = await c.get(parked.id)
            assert (await back.resume()).state == "running"
            assert (await back.run("cat /tmp/mark")).stdout == "parked\n"
            fresh = await c.create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
            assert (await fresh.run("echo new")).stdout == "new\n"
            for s in (sb, back, fresh):
                await s.stop()
    finally:
        for srv in (new, old):
            if srv is not None:
                srv.kill(signal.SIGKILL)
        cleanup_home(home)
