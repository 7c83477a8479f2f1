"""A `dsec up` in its own DSEC_HOME and port, beside whatever else runs on the node.

Tests and benchmarks both need one: a fresh home (no templates, caches or admission shared
with the node's own server), a process they can kill and restart, and afterwards nothing left
behind: containers, VMs, template RAM on tmpfs, mounts, files. Install-time downloads (the
debootstrap cache, the guest kernel) are linked from the node's home instead of fetched again.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dsec.home_qemus import qemu_pids_of
from dsec.config import Paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def link_node_downloads(home: Path, cache: Path | None = None) -> None:
    """Point `home`'s download cache and guest kernel at the node's (`dsec vm fetch-kernel`
    and the image builds put them there at install time)."""
    node = Paths.from_env()
    cache = cache or node.home / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    (home / "cache").symlink_to(cache)
    if (node.vm / "kernel").is_dir():
        Paths(home).vm.mkdir(parents=True, exist_ok=True)
        (Paths(home).vm / "kernel").symlink_to(node.vm / "kernel")


class ServerProcess:
    """A `dsec up` subprocess on `home` that can be killed (-9 too) and started again."""

    def __init__(self, home: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
        """`args`: more `dsec up` options (e.g. `--node-id`)."""
        self.home = home
        self.args = args
        self.port = free_port()
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
        # private like everything the server writes (embedded/server.py: make_private)
        fd = os.open(self.home / "server.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        with open(fd, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "dsec", "up", "--port", str(self.port), *self.args],
                                         env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsec up exited {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"dsec up did not become healthy: {self.log_tail()}")

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 30) -> None:
        """Send `sig` and wait for the process to end (SIGTERM: the edge closes cleanly)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self):
        from dsec.sdk.client import Client
        return Client(self.url, self.key)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.home / "server.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""


def cleanup_home(home: Path) -> list[int]:
    """Remove whatever a (possibly killed) server on `home` left: VMs, containers, template
    RAM, mounts, files. Returns the pids of the QEMUs it had to kill."""
    from dsec.backends.container.lxcfs import Lxcfs
    from dsec.backends.vm.templates import ram_dir
    paths = Paths(home)
    leaked = qemu_pids_of(home)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if paths.crun_root.exists():
        ids = subprocess.run(["crun", "--root", str(paths.crun_root), "list", "-q"],
                             capture_output=True, text=True).stdout.split()
        for cid in ids:
            subprocess.run(["crun", "--root", str(paths.crun_root), "delete", "-f", cid], capture_output=True)
    for on in ("disk", "tmpfs"):
        shutil.rmtree(ram_dir(paths, on), ignore_errors=True)
    Lxcfs(home / "lxcfs").stop()           # the node's daemon outlives its server, by design
    with open("/proc/self/mountinfo") as f:
        mnts = [line.split()[4] for line in f if line.split()[4].startswith(str(home))]
    for m in sorted(mnts, key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)
    shutil.rmtree(home, ignore_errors=True)
    return leaked
