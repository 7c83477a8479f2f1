"""An isolated `dsec up` for benchmarks: its own DSEC_HOME under /var/tmp and its own port, so a
bench never shares templates, caches of built VMs or admission with whatever else runs on the
node, and starts from a known state (no VM template built yet).

The debootstrap cache and the guest kernel are install-time downloads: the bench home links the
node's copies instead of fetching its own (as the test fixtures do).
"""

from __future__ import annotations

import signal
import tempfile
import threading
from pathlib import Path

from dsec.testing.isolated import ServerProcess, cleanup_home, link_node_downloads
from dsec.sdk.client import Client


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class BenchServer(ServerProcess):
    def __init__(self, prefix: str = "dsec-bench-"):
        # a bench stopped with SIGTERM (`timeout`, a CI runner) unwinds through its `finally:
        # close()`: by default Python dies at once, and the VMs it started outlive their server
        # (QEMUs are kept across a server stop on purpose, for the edge to adopt again)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        super().__init__(Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp")))

    def prepare(self, images: list[str]) -> None:
        """Link the node's downloads and build the built-in images into the bench home."""
        from dsec.images.builtin import ensure_builtin
        from dsec.images.service import ImageService
        link_node_downloads(self.home)
        self.paths.ensure()
        svc = ImageService(self.paths)
        for name in images:
            ensure_builtin(svc, name)

    def start(self, timeout_s: float = 120) -> None:
        super().start(timeout_s)

    def client(self) -> Client:
        return Client(self.url, self.key, autostart=False)

    def close(self) -> list[int]:
        """Stop the server and remove the home. Returns the pids of QEMUs that were still alive
        after the server stopped (a leak: the bench stops every VM it starts); they are killed."""
        self.kill(signal.SIGTERM, timeout_s=60)
        return cleanup_home(self.home)
