"""EROFS images: make one from a directory with erofs-utils' mkfs.erofs, hash it, sanity-check it.

Reproducibility: mkfs.erofs 1.5 stamps a random UUID and the build time into the
superblock. We pass a UUID derived from the tree's metadata and SOURCE_DATE_EPOCH = the
newest mtime in the tree (which sets the build time without flattening per-file mtimes,
unlike -T, which would also break Python's mtime-based .pyc validation). Ownership, modes,
xattrs and mtimes are preserved (never --all-root). Same tree => byte-identical image.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import struct
import subprocess
import time
import uuid
from pathlib import Path

from dsec.types import InvalidArgument, Unavailable

from .progress import Progress, report

log = logging.getLogger("dsec.images")

EROFS_SUPER_OFFSET = 1024
EROFS_MAGIC = 0xE0F5E1E2
COMPRESSIONS = (None, "lz4", "lz4hc")
_UUID_NS = uuid.UUID("6f1d3c1e-8a0b-4f55-9a55-0d5ec1a7e2f5")


def mkfs_binary() -> str:
    exe = shutil.which("mkfs.erofs")
    if exe is None:
        raise Unavailable("mkfs.erofs is not installed on this node", field=None,
                          fix="install erofs-utils: apt-get install -y erofs-utils")
    return exe


def check_compression(compression: str | None) -> str | None:
    if compression not in COMPRESSIONS:
        raise InvalidArgument(f"unknown compression {compression!r}", field="compression",
                              fix="use None (uncompressed, fastest reads), 'lz4' or 'lz4hc'")
    return compression


def scan_tree(root: Path) -> tuple[int, uuid.UUID, int]:
    """Walk `root` without following symlinks. Returns (newest mtime in whole seconds,
    a UUID derived from the metadata of every entry, number of entries)."""
    h = hashlib.sha256()
    newest = 0
    count = 0
    stack = [""]
    while stack:
        rel = stack.pop()
        full = os.path.join(root, rel) if rel else str(root)
        st = os.lstat(full)
        count += 1
        newest = max(newest, int(st.st_mtime))
        extra = os.readlink(full) if stat.S_ISLNK(st.st_mode) else ""
        # a directory's st_size depends on the host fs's history, not on its content
        size = 0 if stat.S_ISDIR(st.st_mode) else st.st_size
        h.update(f"{rel}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0{size}\0"
                 f"{st.st_mtime_ns}\0{st.st_rdev}\0{extra}\n".encode("utf-8", "surrogateescape"))
        if stat.S_ISDIR(st.st_mode):
            names = sorted(os.listdir(full), reverse=True)
            stack.extend(os.path.join(rel, n) if rel else n for n in names)
    return newest, uuid.uuid5(_UUID_NS, h.hexdigest()), count


def mkfs(src: Path, out: Path, *, compression: str | None = None,
         progress: Progress | None = None, chunk_size: int | None = None) -> float:
    """Build `out` (must not exist) from directory `src`. Returns seconds taken.
    `chunk_size`: store files as chunks of that size (chunk-based layout): identical chunks,
    the zero-filled holes of sparse files among them, are stored once, so a tree with a
    1 GiB `truncate`d file makes a ~1 MiB image, not a 1 GiB one (mkfs.erofs 1.5 still reads
    the holes: callers bound the tree's apparent size)."""
    check_compression(compression)
    exe = mkfs_binary()
    newest, fs_uuid, entries = scan_tree(src)
    cmd = [exe, "--quiet", f"-U{fs_uuid}"]
    if compression:
        cmd.append(f"-z{compression}")
    if chunk_size:
        cmd.append(f"--chunksize={chunk_size}")
    cmd += [str(out), str(src)]
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(max(newest, 0)), LC_ALL="C")
    report(progress, f"mkfs.erofs: {entries} entries from {src}", None, level=logging.INFO)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=env)
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        tail = proc.stdout.decode(errors="replace").strip()[-2000:]
        raise InvalidArgument(f"mkfs.erofs failed on {src} (exit {proc.returncode}): {tail}",
                              field="path",
                              fix="make sure every file under the directory is readable by root "
                                  "and the store filesystem has free space")
    log.info("mkfs.erofs %s -> %s: %.2fs, %d bytes", src, out.name, dt, out.stat().st_size)
    return dt


def sha256_file(path: Path, *, progress: Progress | None = None, chunk: int = 4 << 20) -> str:
    """sha256:<hex> of a file, reporting progress for big files."""
    size = os.stat(path).st_size
    h = hashlib.sha256()
    done = 0
    last = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            done += n
            if progress is not None and time.monotonic() - last > 0.5:
                last = time.monotonic()
                report(progress, f"hashing {path.name}", done / max(size, 1))
    return "sha256:" + h.hexdigest()


def check_image(path: Path) -> None:
    """Cheap check that `path` starts like an EROFS image (magic in the superblock).
    Raises InvalidArgument with a clear message otherwise."""
    try:
        with open(path, "rb") as f:
            f.seek(EROFS_SUPER_OFFSET)
            head = f.read(4)
    except OSError as e:
        raise InvalidArgument(f"cannot read layer file {path}: {e.strerror}", field="layer",
                              fix="check the layer store is readable; rebuild the image") from e
    if len(head) < 4 or struct.unpack("<I", head)[0] != EROFS_MAGIC:
        raise InvalidArgument(
            f"layer file {path} is not an EROFS image (no EROFS superblock magic at offset 1024)",
            field="layer",
            fix="the layer file is corrupt or truncated: remove the image and build it again")
