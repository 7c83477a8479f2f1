"""Where dsec keeps its state on this node, and node-level settings.

Everything derives from DSEC_HOME (default /var/lib/dsec) so tests and benchmarks can run
an isolated instance beside a user's one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOME = "/var/lib/dsec"
DEFAULT_PORT = 7620


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
