"""Writable VM disks as self-contained backing chains.

A VM's writable disk is a qcow2 overlay over an immutable base: a template's disk (clones), a
snapshot's disk (restore-as-new) or a built boot disk (full VMs). Each base the overlay needs
is hard-linked into the VM's own dir as `chain-<name>` and named by that *relative* path in the
qcow2, which QEMU resolves beside the overlay. So a dir holds its whole chain:

- a snapshot copies the overlay and links the same chain files into the snapshot's dir;
- rebuilding a template (after a reboot, or for a new initramfs), `dsec down` dropping the
  templates, `dsec vm disk build` replacing a disk, or deleting a snapshot removes only one
  link: VMs and snapshots built over the old file keep it until the last of them is gone.

Bases are never written after they are linked (templates chmod 0400 theirs, a snapshot's files
are not opened read-write, disk builds replace files by rename), so sharing the inode is safe.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

PREFIX = "chain-"


def chain_files(d: Path) -> list[Path]:
    """The bases a VM or snapshot dir holds for its overlay."""
    return sorted(d.glob(PREFIX + "*"))


def _link(src: Path, dst: Path) -> None:
    if dst.exists():
        return
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:   # another filesystem: a copy costs space, not correctness
            raise
        shutil.copy2(src, dst)


def adopt(d: Path, base: Path, name: str, parents: Iterable[Path] = ()) -> str:
    """Link `base` (and the chain files it relies on, `parents`) into `d`; returns the relative
    name to give `qemu-img create -b`. Synchronous on purpose: it runs without an await between
    looking at the source and linking it, so a concurrent deletion (a rename first) is seen
    whole or not at all."""
    for p in parents:
        _link(p, d / p.name)
    rel = PREFIX + name
    _link(base, d / rel)
    return rel


def carry(src_dir: Path, dst_dir: Path) -> None:
    """Link every chain file of `src_dir` into `dst_dir` (a snapshot of a VM keeps its bases)."""
    for p in chain_files(src_dir):
        _link(p, dst_dir / p.name)


def own_bytes(d: Path) -> int:
    """Bytes on disk of a dir's files other than its shared bases."""
    return sum(p.stat().st_blocks * 512 for p in d.iterdir()
               if p.is_file() and not p.name.startswith(PREFIX))
