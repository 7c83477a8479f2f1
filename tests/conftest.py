"""Shared fixtures: a real dsec server (apiserver + edge + crun) in an isolated DSEC_HOME.

Tests need root (crun, mounts, cgroups). Each test session gets a fresh home under /var/tmp;
the debootstrap download cache is shared between sessions so debian-python builds fast.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from dsec.config import Paths

# Reuse the install step's debootstrap cache (scripts/install.sh builds the same images there).
SHARED_CACHE = Path(os.environ.get("DSEC_TEST_CACHE", str(Paths.from_env().home / "cache")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requires_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (crun, EROFS mounts, cgroups)")


class ServerProc:
    """A `dsec up` subprocess that tests can kill -9 and restart on the same home."""

    def __init__(self, home: Path, env: dict[str, str] | None = None):
        self.home = home
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "DSEC_HOME": str(home), "DSEC_URL": self.url, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def paths(self) -> Paths:
        return Paths(self.home)

    @property
    def key(self) -> str:
        return self.paths.admin_key_file.read_text().strip()

    def start(self, timeout_s: float = 60) -> None:
        log = open(self.home / "server.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "dsec", "up", "--port", str(self.port)],
                                     env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsec up exited {self.proc.returncode}: "
                                   + (self.home / "server.log").read_text()[-3000:])
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("dsec up did not become healthy")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def client(self):
        from dsec.sdk.client import Client
        return Client(self.url, self.key)


def link_guest_kernel(home: Path) -> None:
    """The guest kernel is an install-time download (`dsec vm fetch-kernel` into the node's
    DSEC_HOME); test homes share it instead of fetching their own."""
    node_kernels = Paths.from_env().vm / "kernel"
    if node_kernels.is_dir():
        Paths(home).vm.mkdir(parents=True, exist_ok=True)
        (Paths(home).vm / "kernel").symlink_to(node_kernels)


def _cleanup_home(home: Path) -> None:
    """Remove whatever a (possibly killed) server left: containers, mounts, files."""
    paths = Paths(home)
    if paths.crun_root.exists():
        ids = subprocess.run(["crun", "--root", str(paths.crun_root), "list", "-q"],
                             capture_output=True, text=True).stdout.split()
        for cid in ids:
            subprocess.run(["crun", "--root", str(paths.crun_root), "delete", "-f", cid], capture_output=True)
    # VMs left by a killed server: their QEMU names carry the sandbox id (dsec-<id>,)
    names = [d.name for d in paths.vm_sandboxes.glob("*")] + [f"tpl-{d.name[:12]}" for d in paths.vm_templates.glob("*")]
    for name in names:
        subprocess.run(["pkill", "-9", "-f", "--", f"-name dsec-{name},"], capture_output=True)
    from dsec.backends.vm.templates import ram_dir
    shutil.rmtree(ram_dir(paths), ignore_errors=True)
    with open("/proc/self/mountinfo") as f:
        mnts = [line.split()[4] for line in f if line.split()[4].startswith(str(home))]
    for m in sorted(mnts, key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def dsec_home():
    requires_root()
    home = Path(tempfile.mkdtemp(prefix="dsec-test-", dir="/var/tmp"))
    SHARED_CACHE.mkdir(parents=True, exist_ok=True)
    (home / "cache").symlink_to(SHARED_CACHE)
    link_guest_kernel(home)
    yield home
    _cleanup_home(home)


@pytest.fixture(scope="session")
def images(dsec_home):
    """The built-in images, built once per session into the test home."""
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService
    paths = Paths(dsec_home)
    paths.ensure()
    svc = ImageService(paths)
    ensure_builtin(svc, "busybox")
    ensure_builtin(svc, "debian-python")
    ensure_builtin(svc, "fncall-python")
    return svc


@pytest.fixture(scope="session")
def server(dsec_home, images):
    srv = ServerProc(dsec_home, env={"DSEC_VM_PING_S": "2"})   # hung-guest checks within seconds
    srv.start()
    yield srv
    srv.kill(signal.SIGTERM)


@pytest.fixture
async def client(server):
    c = server.client()
    async with c:
        yield c
