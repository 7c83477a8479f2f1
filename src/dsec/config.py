"""Where dsec keeps its state on this node, node-level settings, and what this install holds.

Everything derives from DSEC_HOME (default /var/lib/dsec) so tests and benchmarks can run
an isolated instance beside a user's one.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOME = "/var/lib/dsec"
DEFAULT_PORT = 7620

# -- the install: `pip install dsec-sandbox` is the client (SDK, shared types, the CLI's client
# commands); `pip install 'dsec-sandbox[server]'` adds what serving needs (`dsec up`, backends, images,
# VM disks, benchmarks). Here, not in a module of its own, because the SDK may import only
# dsec.sdk, dsec.types and dsec.config (scripts/check_architecture.py).
SERVER_INSTALL = "pip install 'dsec-sandbox[server]'"
# Top-level modules only the server side imports: the [server] extra's packages and what they
# alone pull in (starlette comes with fastapi). tests/test_packaging.py keeps this and
# pyproject.toml in step.
SERVER_MODULES = frozenset({"fastapi", "starlette", "uvicorn", "qemu", "structlog", "wsproto", "dnslib", "prometheus_client",
                            "cryptography"})
_SERVER_ENTRY_MODULES = ("fastapi", "uvicorn", "structlog", "qemu.qmp")   # all present: extra installed


def missing_server_module(exc: ImportError) -> str | None:
    """The server-only module an ImportError is about, or None if it is about anything else."""
    root = (exc.name or "").partition(".")[0]
    return root if root in SERVER_MODULES else None


def server_installed() -> bool:
    """Whether this environment can serve (the [server] extra is installed)."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in _SERVER_ENTRY_MODULES)
    except ImportError:   # find_spec("qemu.qmp") imports the parent package "qemu"
        return False


@dataclass(frozen=True)
class Paths:
    home: Path

    @classmethod
    def from_env(cls) -> "Paths":
        return cls(Path(os.environ.get("DSEC_HOME", DEFAULT_HOME)))

    # images
    @property
    def store(self) -> Path:          # content-addressed layer files (may be a shared FS later)
        return self.home / "store"

    @property
    def layer_mounts(self) -> Path:   # one file-backed EROFS mount per layer per node
        return self.home / "mnt"

    @property
    def images_db(self) -> Path:
        return self.home / "images.db"

    # edge
    @property
    def sandboxes(self) -> Path:      # per-sandbox upper/work/rootfs/run dirs
        return self.home / "sb"

    @property
    def edge_db(self) -> Path:
        return self.home / "edge.db"

    @property
    def crun_root(self) -> Path:      # crun state dir private to this instance
        return self.home / "crun"

    @property
    def bin(self) -> Path:            # compiled native helpers (agent, nsexec)
        return self.home / "bin"

    # VM backends (microvm, vm)
    @property
    def vm(self) -> Path:             # guest kernel, initramfs, templates, VM sandboxes
        return self.home / "vm"

    @property
    def vm_sandboxes(self) -> Path:   # per-VM dirs: disks, sockets, console log, pidfile
        return self.vm / "sb"

    @property
    def vm_templates(self) -> Path:   # per-environment template snapshots (state, upper disk)
        return self.vm / "templates"

    @property
    def vm_snapshots(self) -> Path:   # sb.snapshot(): state, disk delta, linked bases (chain.py)
        return self.vm / "snapshots"

    # apiserver / iam
    @property
    def iam_db(self) -> Path:
        return self.home / "iam.db"

    @property
    def admin_key_file(self) -> Path:
        return self.home / "admin.key"

    @property
    def server_log(self) -> Path:
        return self.home / "server.log"

    @property
    def server_pid(self) -> Path:
        return self.home / "server.pid"

    def ensure(self) -> None:
        for p in (self.home, self.store, self.layer_mounts, self.sandboxes, self.crun_root, self.bin):
            p.mkdir(parents=True, exist_ok=True)
        os.chmod(self.home, 0o711)
        # every tenant's layers are mounted here (their mount points are in /proc/mounts for all
        # to see): root alone walks in; sandboxes get them through root-made (idmapped) mounts
        os.chmod(self.layer_mounts, 0o700)
