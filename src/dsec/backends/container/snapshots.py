"""Container snapshots: a sandbox's filesystem (its writable layer) kept as a read-only btrfs
snapshot on the node's scratch filesystem, and stacked as a layer under new sandboxes (fork,
create with `snapshot=`): no byte is copied, no id is rewritten (docs/decisions.md, fork).

    sb/.snap/<snapshot id>/meta.json      image, project, source, created_at, the source's args,
                                          `chain` (see below), size_bytes once measured
    sb/.snap/<snapshot id>/fs/            read-only snapshot of the source's subvolume sb/<source>;
                                          fs/upper is the layer
    sb/.snap/<snapshot id>/users/<sbid>   one empty file per sandbox whose overlay stacks it
    sb/.snap/<snapshot id>/deleted        its owner deleted it: unlisted, and removed once the
                                          last user has ended (a running fork never loses a layer)

A snapshot's `chain` is [[snapshot id, disk id base], ...], oldest first, ending with itself:
a sandbox made from snapshot B, itself taken of a sandbox made from A, stacks A's and B's
layers. The disk id base is the host uid of the source's root (its user namespace range): the
layer's files carry those ids, and nsexec shows them to a new sandbox through a mount idmapped
base -> the new sandbox's range (nsexec -s), as the image layers are shown (-l).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Any

from dsec.backends.container.disk import _IOC_SNAP_DESTROY, PolledQuotas, _dir_ioctl, _vol_args
from dsec.types import Conflict, NotFound, Unavailable

log = logging.getLogger("dsec.backends.container.snapshots")

SNAP_DIR = ".snap"             # under sb/: on the scratch btrfs (a snapshot stays in its filesystem)
CHAIN_FILE = "snapshots.json"  # in a sandbox's run/: the chain its overlay stacks (released at destroy)
MAX_CHAIN = 64                 # layers a chain of forks of forks may stack

_IOC_SNAP_CREATE_V2 = 0x50009417   # _IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2), 4096 bytes
_SUBVOL_RDONLY = 1 << 1


def _snap_create(source: Path, dest_dir: Path, name: str) -> None:
    """A read-only btrfs snapshot of the subvolume `source` at dest_dir/name (one transaction
    commit: ~ms, whatever the subvolume holds; its delayed writes are flushed first)."""
    raw = os.fsencode(name)
    src = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # {s64 fd; u64 transid; u64 flags; u64 unused[4]; char name[4040]}
        arg = bytearray(struct.pack("qQQ4Q", src, 0, _SUBVOL_RDONLY, 0, 0, 0, 0) + raw + b"\0" * (4040 - len(raw)))
        _dir_ioctl(dest_dir, _IOC_SNAP_CREATE_V2, arg)
    finally:
        os.close(src)


class ContainerSnapshots:
    """The node's container snapshots (module doc); every method does file I/O: call in a thread."""

    def __init__(self, sandboxes: Path, quotas: PolledQuotas):
        self.root = sandboxes / SNAP_DIR
        self.sandboxes = sandboxes
        self.quotas = quotas
        self._lock = threading.Lock()      # users/deleted bookkeeping, one change at a time

    @property
    def available(self) -> bool:
        return self.quotas.enforced and self.quotas.kind.startswith("btrfs")

    def _check(self) -> None:
        if not self.available:
            raise Unavailable("container snapshots and forks need the btrfs scratch filesystem; this node polls "
                              f"disk quotas instead ({getattr(self.quotas, 'reason', '') or 'DSEC_DISK_QUOTA=poll'})",
                              field="sandbox_id", fix="install btrfs-progs (scripts/install.sh), unset "
                                                      "DSEC_DISK_QUOTA=poll and restart the node")

    def dir(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id

    def layer(self, snapshot_id: str) -> Path:
        return self.dir(snapshot_id) / "fs" / "upper"

    # -- take ---------------------------------------------------------------------------------
    def take(self, source: Path, snapshot_id: str, meta: dict[str, Any]) -> None:
        """Snapshot the sandbox directory `source` (frozen by the caller) with `meta`; its chain
        is the source's own (run/snapshots.json) plus this one."""
        self._check()
        chain = self.chain_of(source) + [[snapshot_id, meta.get("disk_base")]]
        if len(chain) > MAX_CHAIN:
            raise Conflict(f"this sandbox already stacks {len(chain) - 1} snapshot layers (forks of forks); "
                           f"at most {MAX_CHAIN}", field="sandbox_id",
                           fix="pack_diff it into an image and create from that")
        self.root.mkdir(mode=0o700, exist_ok=True)
        d = self.dir(snapshot_id)
        d.mkdir(mode=0o700)
        try:
            (d / "users").mkdir(mode=0o700)
            _snap_create(source, d, "fs")
            _write_json(d / "meta.json", {**meta, "id": snapshot_id, "chain": chain})
        except BaseException:
            self._remove(d)
            raise

    @staticmethod
    def chain_of(sandbox_dir: Path) -> list[list[Any]]:
        """The snapshots a sandbox's overlay stacks (oldest first), as recorded at its create."""
        try:
            return list(json.loads((sandbox_dir / "run" / CHAIN_FILE).read_text()))
        except (OSError, ValueError):
            return []

    # -- read ---------------------------------------------------------------------------------
    def meta(self, snapshot_id: str) -> dict[str, Any]:
        d = self.dir(snapshot_id)
        try:
            if (d / "deleted").exists():
                raise FileNotFoundError
            return dict(json.loads((d / "meta.json").read_text()))
        except (OSError, ValueError):
            raise NotFound(f"no container snapshot {snapshot_id!r} on this node", field="snapshot",
                           fix="use an id returned by Sandbox.snapshot(); list them with GET /v1/snapshots") from None

    def record(self, snapshot_id: str) -> dict[str, Any]:
        """What SnapshotInfo is made of; the layer's bytes are measured once (a walk) and kept."""
        m = self.meta(snapshot_id)
        size = m.get("size_bytes")
        if size is None:
            size = PolledQuotas.usage(self.layer(snapshot_id))
            try:
                _write_json(self.dir(snapshot_id) / "meta.json", {**m, "size_bytes": size})
            except OSError:
                pass
        return {"id": snapshot_id, "backend": "container", "image": m.get("image", ""),
                "project": m.get("project", ""), "sandbox_id": m.get("source", ""),
                "created_at": m.get("created_at", 0.0), "size_bytes": size, "name": m.get("name")}

    def ids(self) -> list[str]:
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        return [n for n in names if not (self.root / n / "deleted").exists()]

    def records(self) -> list[dict[str, Any]]:
        out = []
        for sid in self.ids():
            try:
                out.append(self.record(sid))
            except NotFound:
                continue
        return out

    # -- use ----------------------------------------------------------------------------------
    def use(self, snapshot_id: str, sandbox_dir: Path) -> list[list[Any]]:
        """Mark `sandbox_dir`'s sandbox as a user of the snapshot's whole chain and record the
        chain in its run/ (the bundle exists); returns the chain."""
        with self._lock:
            chain = self.meta(snapshot_id)["chain"]
            _write_json(sandbox_dir / "run" / CHAIN_FILE, chain)
            for sid, _ in chain:
                if not self.layer(sid).is_dir():
                    raise NotFound(f"snapshot layer {sid} of {snapshot_id} is gone", field="snapshot",
                                   fix="take a new snapshot")
                (self.dir(sid) / "users" / sandbox_dir.name).touch(mode=0o600)
        return list(chain)

    def release(self, sandbox_dir: Path) -> None:
        """The sandbox ended: it no longer holds its chain; deleted snapshots nobody uses go."""
        chain = self.chain_of(sandbox_dir)
        with self._lock:
            for sid, _ in chain:
                (self.dir(sid) / "users" / sandbox_dir.name).unlink(missing_ok=True)
                self._collect(sid)

    def delete(self, snapshot_id: str) -> None:
        """Unlisted at once; its files go now if no sandbox stacks it, else with its last user."""
        self.meta(snapshot_id)          # NotFound for an unknown or already deleted one
        with self._lock:
            (self.dir(snapshot_id) / "deleted").touch(mode=0o600)
            self._collect(snapshot_id)

    def sweep(self) -> None:
        """After an edge restart: users whose sandbox directory is gone (a crash between the
        two) are dropped, then deleted snapshots nobody uses are removed."""
        for sid in (os.listdir(self.root) if self.root.is_dir() else []):
            users = self.dir(sid) / "users"
            for u in (os.listdir(users) if users.is_dir() else []):
                if not (self.sandboxes / u).is_dir():
                    (users / u).unlink(missing_ok=True)
            with self._lock:
                self._collect(sid)

    def _collect(self, snapshot_id: str) -> None:
        d = self.dir(snapshot_id)
        if not (d / "deleted").exists():
            return
        try:
            if os.listdir(d / "users"):
                return
        except FileNotFoundError:
            pass
        self._remove(d)
        log.info("snapshot removed", extra={"snapshot": snapshot_id})

    def _remove(self, d: Path) -> None:
        if (d / "fs").exists():
            try:
                _dir_ioctl(d, _IOC_SNAP_DESTROY, _vol_args("fs"))
            except OSError as e:
                if e.errno != errno.ENOENT:
                    log.warning("could not remove a snapshot subvolume", extra={"path": str(d), "error": str(e)})
                    return
        for name in ("meta.json", "deleted", "meta.json.tmp"):
            (d / name).unlink(missing_ok=True)
        for p in ((d / "users").iterdir() if (d / "users").is_dir() else []):
            p.unlink(missing_ok=True)
        for sub in ("users", ""):
            try:
                os.rmdir(d / sub if sub else d)
            except OSError:
                pass


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
