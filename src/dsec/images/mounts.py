"""One read-only, file-backed EROFS mount per layer per node.

mount(2) is called directly through ctypes with the image *file* as source, so the kernel
uses its file-backed EROFS mode (util-linux `mount` would quietly attach a loop device).
`directio` makes EROFS read the file with O_DIRECT, so its data is cached once (in EROFS's
page cache), not twice. Every overlay that uses the layer as a lowerdir shares that copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsec.config import Paths
from dsec.types import DsecError, InvalidArgument, NotFound, Unavailable

from .erofs import check_image
from .store import FileLock, check_digest, layer_file

log = logging.getLogger("dsec.images")

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2
MOUNT_FLAGS = MS_RDONLY | MS_NODEV | MS_NOSUID
MOUNT_DATA = "directio"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.mount.restype = ctypes.c_int
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.umount2.restype = ctypes.c_int


def sys_mount(source: str, target: str, fstype: str, flags: int, data: str | None) -> None:
    rc = _libc.mount(os.fsencode(source), os.fsencode(target), fstype.encode(), flags,
                     data.encode() if data is not None else None)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), target)


def sys_umount(target: str, flags: int = MNT_DETACH) -> None:
    if _libc.umount2(os.fsencode(target), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), target)


# ---------------------------------------------------------------------------------------
# /proc/self/mountinfo
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MountEntry:
    mount_id: int
    major_minor: str
    mountpoint: str
    options: str          # per-mount options (ro, nosuid, ...)
    fstype: str
    source: str
    super_options: str    # per-superblock options (directio, ...)


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo (octal)
    if "\\" not in s:
        return s
    out = bytearray()
    i = 0
    raw = s.encode("utf-8", "surrogateescape")
    while i < len(raw):
        if raw[i] == 0x5C and i + 4 <= len(raw) and raw[i + 1:i + 4].isdigit():
            out.append(int(raw[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def mountinfo() -> list[MountEntry]:
    entries = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.rstrip("\n").partition(" - ")
            a = left.split(" ")
            b = right.split(" ")
            if len(a) < 6 or len(b) < 3:
                continue
            entries.append(MountEntry(int(a[0]), a[2], _unescape(a[4]), a[5], b[0],
                                      _unescape(b[1]), b[2]))
    return entries


def mounts_under(path: Path) -> list[MountEntry]:
    """Mounts at or below `path`, deepest first."""
    p = os.path.realpath(path)
    found = [m for m in mountinfo() if m.mountpoint == p or m.mountpoint.startswith(p.rstrip("/") + "/")]
    return sorted(found, key=lambda m: (m.mountpoint.count("/"), m.mount_id), reverse=True)


def detach_all_under(path: Path) -> int:
    """Lazily unmount everything at or below `path` (deepest first). Returns how many."""
    n = 0
    for _ in range(64):
        found = mounts_under(path)
        if not found:
            return n
        for m in found:
            try:
                sys_umount(m.mountpoint, MNT_DETACH)
                n += 1
                log.info("detached %s (%s) under %s", m.mountpoint, m.fstype, path)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOENT):
                    raise
    raise Unavailable(f"could not unmount everything under {path}", field=None,
                      fix=f"inspect `grep {path} /proc/self/mountinfo` and unmount by hand")


# ---------------------------------------------------------------------------------------
# Layer mounts
# ---------------------------------------------------------------------------------------


class LayerMounts:
    """Mount layers at Paths.layer_mounts/<hex>, once per node, idempotently.

    Safe to call from many threads and processes at once: mounting and unmounting hold an
    exclusive flock on Paths.layer_mounts/.lock, and the mount table is re-read under it.
    """

    def __init__(self, paths: Paths, source: "Callable[[str], Path] | None" = None):
        self.paths = paths
        self.source = source      # digest -> file to mount (default: the store's layer file)
        self.root = paths.layer_mounts
        self._lock = FileLock(self.root / ".lock")

    def mountpoint(self, digest: str) -> Path:
        return self.root / check_digest(digest).split(":", 1)[1]

    def _find(self, digest: str, table: list[MountEntry] | None = None) -> MountEntry | None:
        target = os.path.realpath(self.mountpoint(digest))
        for m in reversed(table if table is not None else mountinfo()):
            if m.mountpoint == target:
                return m if m.fstype == "erofs" else None
        return None

    def is_mounted(self, digest: str) -> bool:
        return self._find(digest) is not None

    def mounted(self) -> list[str]:
        """Digests of the layers currently mounted under this node's layer_mounts."""
        root = os.path.realpath(self.root).rstrip("/") + "/"
        out = []
        for m in mountinfo():
            if m.fstype == "erofs" and m.mountpoint.startswith(root):
                name = m.mountpoint[len(root):]
                if "/" not in name and len(name) == 64:
                    out.append("sha256:" + name)
        return sorted(set(out))

    def ensure_mounted(self, digest: str) -> Path:
        mp = self.mountpoint(digest)
        if self._find(digest) is not None:            # fast path, no lock
            return mp
        image = self.source(digest) if self.source else layer_file(self.paths, digest)
        with self._lock:
            if self._find(digest) is not None:
                return mp
            if not image.is_file():
                raise NotFound(f"layer {digest} is not in the store ({image} is missing)",
                               field="layer",
                               fix="rebuild the image that uses this layer, or copy the layer "
                                   "file into the store")
            check_image(image)
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)     # see Paths.ensure
            created = False
            try:
                mp.mkdir()
                created = True
            except FileExistsError:
                pass
            t0 = time.monotonic()
            try:
                try:
                    sys_mount(str(image), str(mp), "erofs", MOUNT_FLAGS, MOUNT_DATA)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    # Kernels or store filesystems without direct I/O support refuse the
                    # option; a corrupt image fails again below and reports the first error.
                    try:
                        sys_mount(str(image), str(mp), "erofs", MOUNT_FLAGS, None)
                    except OSError:
                        raise e from None
                    log.warning("mounted %s without 'directio' (refused by the kernel or the "
                                "store filesystem): its data is cached twice", image)
            except OSError as e:
                if created:
                    try:
                        mp.rmdir()
                    except OSError:
                        pass
                raise self._mount_error(image, e) from e
            log.info("mounted layer %s at %s in %.1f ms", digest[:19], mp,
                     (time.monotonic() - t0) * 1000)
            return mp

    @staticmethod
    def _mount_error(image: Path, e: OSError) -> DsecError:
        if e.errno == errno.ENOTBLK:
            return Unavailable("this kernel cannot mount EROFS images from files", field=None,
                               fix="use Linux >= 6.12 with CONFIG_EROFS_FS_BACKED_BY_FILE=y")
        if e.errno in (errno.EINVAL, errno.EUCLEAN, errno.EBADMSG, errno.EFBIG, errno.EIO,
                       errno.EOPNOTSUPP):
            return InvalidArgument(
                f"layer file {image} is not a valid EROFS image: the kernel refused to mount it "
                f"({errno.errorcode.get(e.errno, e.errno)}: {e.strerror}); see `dmesg` for the "
                f"EROFS message", field="layer",
                fix="the layer is corrupt or was built by an incompatible mkfs.erofs: remove the "
                    "image and build it again")
        if e.errno in (errno.EPERM, errno.EACCES):
            return Unavailable(f"not allowed to mount {image}: {e.strerror}", field=None,
                               fix="run as root (CAP_SYS_ADMIN in the initial user namespace)")
        if e.errno == errno.ENODEV:
            return Unavailable("this kernel has no EROFS support", field=None,
                               fix="load the erofs module (modprobe erofs) or use a kernel with "
                                   "CONFIG_EROFS_FS and CONFIG_EROFS_FS_BACKED_BY_FILE")
        return Unavailable(f"mounting {image} failed: {e.strerror}", field=None,
                           fix="check `dmesg` and the layer store filesystem")

    def unmount(self, digest: str) -> bool:
        """Detach the layer's mount (existing users keep it until they let go) and remove
        the mountpoint dir. Returns whether anything was mounted."""
        mp = self.mountpoint(digest)
        with self._lock:
            was = False
            for _ in range(16):  # stacked mounts, should there ever be any
                if self._find(digest) is None:
                    break
                try:
                    sys_umount(str(mp), MNT_DETACH)
                    was = True
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.ENOENT):
                        raise
            try:
                mp.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("could not remove mountpoint %s: %s", mp, e)
            if was:
                log.info("unmounted layer %s", digest[:19])
            return was

    def unmount_all(self) -> int:
        """Detach every EROFS layer mount under this node's layer_mounts. Returns how many."""
        n = 0
        with self._lock:
            for digest in self.mounted():
                n += bool(self.unmount(digest))
        return n
