"""An isolated `dsec up` for benchmarks: its own DSEC_HOME under /var/tmp and its own port, so a
bench never shares templates, caches of built VMs or admission with whatever else runs on the
node, and starts from a known state (no VM template built yet).

The debootstrap cache and the guest kernel are install-time downloads: the bench home links the
node's copies instead of fetching its own (as the test fixtures do).
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

from dsec.config import Paths
from dsec.sdk.client import Client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BenchServer:
    def __init__(self, prefix: str = "dsec-bench-"):
        self.home = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
        self.paths = Paths(self.home)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def prepare(self, images: list[str]) -> None:
        """Link the node's caches and build the built-in images into the bench home."""
        from dsec.images.builtin import ensure_builtin
        from dsec.images.service import ImageService
        node = Paths.from_env()
        (node.home / "cache").mkdir(parents=True, exist_ok=True)
        (self.home / "cache").symlink_to(node.home / "cache")
        if (node.vm / "kernel").is_dir():
            self.paths.vm.mkdir(parents=True, exist_ok=True)
            (self.paths.vm / "kernel").symlink_to(node.vm / "kernel")
        self.paths.ensure()
        svc = ImageService(self.paths)
        for name in images:
            ensure_builtin(svc, name)

    def start(self, timeout_s: float = 120) -> None:
        env = {**os.environ, "DSEC_HOME": str(self.home), "DSEC_URL": self.url}
        with open(self.home / "server.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "dsec", "up", "--port", str(self.port)],
                                         env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsec up exited {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"dsec up did not become healthy: {self.log_tail()}")

    def client(self) -> Client:
        return Client(self.url, self.paths.admin_key_file.read_text().strip(), autostart=False)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.home / "server.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def qemu_pids(self) -> list[int]:
        """QEMU processes started from this home (their argv names files under it)."""
        pids = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"qemu-system-x86_64") and any(str(self.home).encode() in a for a in argv):
                pids.append(int(p.name))
        return pids

    def close(self) -> list[int]:
        """Stop the server and remove the home. Returns the pids of QEMUs that were still alive
        after the server stopped (a leak: the bench stops every VM it starts); they are killed."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        leaked = self.qemu_pids()
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.paths.crun_root.exists():
            ids = subprocess.run(["crun", "--root", str(self.paths.crun_root), "list", "-q"],
                                 capture_output=True, text=True).stdout.split()
            for cid in ids:
                subprocess.run(["crun", "--root", str(self.paths.crun_root), "delete", "-f", cid], capture_output=True)
        from dsec.backends.vm.templates import ram_dir
        shutil.rmtree(ram_dir(self.paths), ignore_errors=True)
        with open("/proc/self/mountinfo") as f:
            mnts = [line.split()[4] for line in f if line.split()[4].startswith(str(self.home))]
        for m in sorted(mnts, key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        shutil.rmtree(self.home, ignore_errors=True)
        return leaked
