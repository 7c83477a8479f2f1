"""Files of a volume, read and written on the host (the volume API: E2B's volume content routes,
dsec's /v1/volumes/{name}/file...).

The edge runs as root and the volume's files were written by sandboxes, so nothing here follows
a link a sandbox left: every path is walked one component at a time from an fd of the volume
root with O_NOFOLLOW (a symlink anywhere in the path is refused by name, never resolved; `..`
is refused before the walk), a file is opened as O_PATH first and reopened only once fstat says
it is a regular file (a FIFO or device node is never opened), and directories are removed with
fd-relative calls (shutil.rmtree with dir_fd). Files keep in-sandbox ids on disk (D61): what
the API writes belongs to uid/gid 1000 (the default user) unless the caller names others.
Where the volume's quota is measured rather than enforced by the kernel, a write that would
take the volume past its size is refused before it starts.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from dsec.types import PayloadTooLarge, Conflict, InvalidArgument, NotFound, VolumeEntry

OWNER_ID = 1000             # the default user in every sandbox (the volume root's owner)
MAX_ID = 65535              # ids a sandbox's range maps (its user namespace is 65536 wide)
MAX_DEPTH = 16
MAX_ENTRIES = 10_000
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def parts_of(path: str) -> list[str]:
    """The components of a volume path ('/a/b', 'a/b', '/' for the root); `..` is refused."""
    if "\0" in path:
        raise InvalidArgument("path has a NUL byte", field="path", fix="pass a plain path inside the volume")
    out = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in out:
        raise InvalidArgument(f"path {path[:200]!r} has '..': volume paths stay inside the volume", field="path",
                              fix="name the file from the volume's root, e.g. '/dir/file'")
    return out


def _refused(path: str, e: OSError) -> Exception:
    if e.errno == errno.ENOENT:
        return NotFound(f"path {path[:200]!r} not found in the volume", field="path",
                        fix="list the volume's files (Volume.list('/') / `dsec volume ls NAME`)")
    if e.errno in (errno.ELOOP, errno.EMLINK):
        return InvalidArgument(f"path {path[:200]!r} goes through a symlink: the volume API does not follow links",
                               field="path", fix="name the link's target path itself")
    if e.errno == errno.ENOTDIR:
        return InvalidArgument(f"path {path[:200]!r}: a part of it is not a directory", field="path",
                               fix="name a path whose parents are directories")
    if e.errno == errno.EISDIR:
        return InvalidArgument(f"path {path[:200]!r} is a directory", field="path",
                               fix="name a file, or list the directory")
    if e.errno == errno.EEXIST:
        return Conflict(f"path {path[:200]!r} exists", field="path", fix="remove it first, or pick another path")
    if e.errno == errno.ENOTEMPTY:
        return Conflict(f"directory {path[:200]!r} is not empty", field="path", fix="remove what it holds first")
    if e.errno in (errno.EDQUOT, errno.ENOSPC):
        return PayloadTooLarge(f"the volume is full writing {path[:200]!r}", field="size_mb",
                                fix="remove files from the volume, or create a larger one")
    return InvalidArgument(f"path {path[:200]!r}: {os.strerror(e.errno or 0)}", field="path",
                           fix="check the path")


def _check_ids(uid: int | None, gid: int | None, mode: int | None) -> None:
    for name, v in (("uid", uid), ("gid", gid)):
        if v is not None and not 0 <= v <= MAX_ID:
            raise InvalidArgument(f"{name} {v} is outside a sandbox's ids (0..{MAX_ID})", field=name,
                                  fix=f"pass an id a sandbox uses, e.g. {OWNER_ID} (the default user) or 0")
    if mode is not None and not 0 <= mode <= 0o7777:
        raise InvalidArgument(f"mode {mode:o} is not a permission mode", field="mode", fix="pass e.g. 0o644")
    if mode is not None and mode & (stat.S_ISUID | stat.S_ISGID):
        raise InvalidArgument("mode: set-uid and set-gid bits are not set through the volume API", field="mode",
                              fix="pass permission bits only, e.g. 0o755")


class VolumeFiles:
    """The files of one volume directory `root` (trusted: dsec made it). `room(n)`: refuse
    a write of n more bytes when the volume's quota is measured, not kernel-enforced."""

    def __init__(self, root: Path, room: Callable[[int], None] | None = None):
        self.root = root
        self.room = room

    @contextmanager
    def _dir(self, parts: list[str], path: str, create: bool = False,
             ids: tuple[int, int] = (OWNER_ID, OWNER_ID)) -> Iterator[int]:
        """An fd of the directory `parts` names, never through a symlink; `create`: make the
        missing ones (0755, owned by `ids`)."""
        fd = os.open(self.root, _DIR)
        try:
            for p in parts:
                try:
                    nfd = os.open(p, _DIR, dir_fd=fd)
                except NotADirectoryError:       # O_DIRECTORY|O_NOFOLLOW on a link: say it is one
                    if stat.S_ISLNK(os.stat(p, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise OSError(errno.ELOOP, "symlink") from None
                    raise
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(p, 0o755, dir_fd=fd)
                        os.chown(p, *ids, dir_fd=fd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                    nfd = os.open(p, _DIR, dir_fd=fd)
                os.close(fd)
                fd = nfd
            yield fd
        except OSError as e:
            raise _refused(path, e) from None
        finally:
            os.close(fd)

    def _entry(self, dir_fd: int, name: str, path: str) -> VolumeEntry:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False) if name else os.fstat(dir_fd)
        kind = ("directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                else "symlink" if stat.S_ISLNK(st.st_mode) else "unknown")
        target = os.readlink(name, dir_fd=dir_fd) if kind == "symlink" else None

        def t(x: float) -> datetime:
            return datetime.fromtimestamp(x, timezone.utc)
        return VolumeEntry(name=name or "/", type=kind, path=path, size=st.st_size, mode=stat.S_IMODE(st.st_mode),
                           uid=st.st_uid, gid=st.st_gid, atime=t(st.st_atime), mtime=t(st.st_mtime),
                           ctime=t(st.st_ctime), target=target)

    @staticmethod
    def _norm(parts: list[str]) -> str:
        return "/" + "/".join(parts)

    # -- verbs ------------------------------------------------------------------------------
    def stat(self, path: str) -> VolumeEntry:
        parts = parts_of(path)
        with self._dir(parts[:-1], path) as d:
            try:
                return self._entry(d, parts[-1] if parts else "", self._norm(parts))
            except OSError as e:
                raise _refused(path, e) from None

    def read(self, path: str, maxlen: int) -> bytes:
        parts = parts_of(path)
        if not parts:
            raise _refused(path, OSError(errno.EISDIR, "is a directory"))
        with self._dir(parts[:-1], path) as d:
            try:
                pfd = os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
            except OSError as e:
                raise _refused(path, e) from None
            try:
                st = os.fstat(pfd)
                if stat.S_ISLNK(st.st_mode):
                    raise _refused(path, OSError(errno.ELOOP, "symlink"))
                if stat.S_ISDIR(st.st_mode):
                    raise _refused(path, OSError(errno.EISDIR, "is a directory"))
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidArgument(f"path {path[:200]!r} is not a regular file", field="path",
                                          fix="read regular files only")
                if st.st_size > maxlen:
                    raise PayloadTooLarge(f"file {path[:200]!r} has {st.st_size} bytes, more than {maxlen} "
                                           "read at once", field="path", fix="read it through a sandbox that "
                                                                              "mounts the volume")
                # the O_PATH fd is this very inode: reopening it cannot land on another file
                fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC)
            finally:
                os.close(pfd)
        with os.fdopen(fd, "rb") as f:
            return f.read(maxlen + 1)[:maxlen]

    def write(self, path: str, data: bytes, uid: int | None = None, gid: int | None = None,
              mode: int | None = None, mkdirs: bool = True) -> VolumeEntry:
        _check_ids(uid, gid, mode)
        parts = parts_of(path)
        if not parts:
            raise _refused(path, OSError(errno.EISDIR, "is a directory"))
        ids = (OWNER_ID if uid is None else uid, OWNER_ID if gid is None else gid)
        if self.room is not None:
            self.room(len(data))
        with self._dir(parts[:-1], path, create=mkdirs) as d:
            name = parts[-1]
            # O_NOFOLLOW: a symlink left at the name is refused, never written through;
            # O_NONBLOCK: a FIFO there does not hang the edge (fstat refuses it below)
            flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            created = True
            try:
                try:
                    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=d)
                except FileExistsError:
                    created = False
                    fd = os.open(name, flags, dir_fd=d)
            except OSError as e:
                raise _refused(path, e) from None
            if created and mode is None:
                mode = 0o644          # not the edge's umask
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise InvalidArgument(f"path {path[:200]!r} is not a regular file", field="path",
                                          fix="write regular files only")
                os.ftruncate(fd, 0)
                if created or uid is not None or gid is not None:
                    os.fchown(fd, *ids)
                if mode is not None:
                    os.fchmod(fd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError as e:
                if created:            # a file the API began (e.g. past the quota) is not left half-written
                    try:
                        os.unlink(name, dir_fd=d)
                    except OSError:
                        pass
                raise _refused(path, e) from None
            finally:
                os.close(fd)
            return self._entry(d, name, self._norm(parts))

    def mkdir(self, path: str, uid: int | None = None, gid: int | None = None, mode: int | None = None,
              parents: bool = False) -> VolumeEntry:
        _check_ids(uid, gid, mode)
        parts = parts_of(path)
        if not parts:
            raise _refused(path, OSError(errno.EEXIST, "exists"))
        ids = (OWNER_ID if uid is None else uid, OWNER_ID if gid is None else gid)
        with self._dir(parts[:-1], path, create=parents, ids=ids) as d:
            try:
                os.mkdir(parts[-1], 0o700, dir_fd=d)
                fd = os.open(parts[-1], _DIR, dir_fd=d)
                try:
                    os.fchown(fd, *ids)
                    os.fchmod(fd, 0o755 if mode is None else mode)     # not through the umask
                finally:
                    os.close(fd)
                return self._entry(d, parts[-1], self._norm(parts))
            except OSError as e:
                raise _refused(path, e) from None

    def update(self, path: str, uid: int | None = None, gid: int | None = None,
               mode: int | None = None) -> VolumeEntry:
        """chown/chmod (E2B's update_metadata): on the entry itself, never through a link."""
        _check_ids(uid, gid, mode)
        parts = parts_of(path)
        with self._dir(parts if not parts else parts[:-1], path) as d:
            name = parts[-1] if parts else ""
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False) if name else os.fstat(d)
                if stat.S_ISLNK(st.st_mode):
                    raise _refused(path, OSError(errno.ELOOP, "symlink"))
                fd = os.open(name, _DIR if stat.S_ISDIR(st.st_mode) else os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=d) if name else os.dup(d)
                try:
                    if uid is not None or gid is not None:
                        os.chown(f"/proc/self/fd/{fd}", -1 if uid is None else uid, -1 if gid is None else gid)
                    if mode is not None:
                        os.chmod(f"/proc/self/fd/{fd}", mode)
                finally:
                    os.close(fd)
                return self._entry(d, name, self._norm(parts))
            except OSError as e:
                raise _refused(path, e) from None

    def entries(self, path: str, depth: int = 1) -> list[VolumeEntry]:
        """What directory `path` holds, `depth` levels down (symlinked directories not entered)."""
        if not 1 <= depth <= MAX_DEPTH:
            raise InvalidArgument(f"depth {depth} must be 1..{MAX_DEPTH}", field="depth", fix="pass a smaller depth")
        parts = parts_of(path)
        out: list[VolumeEntry] = []
        with self._dir(parts, path) as d:
            self._walk(d, self._norm(parts).rstrip("/"), depth, out)
        return out

    def _walk(self, d: int, base: str, depth: int, out: list[VolumeEntry]) -> None:
        for name in sorted(os.listdir(d)):
            if len(out) >= MAX_ENTRIES:
                return
            try:
                e = self._entry(d, name, f"{base}/{name}")
            except OSError:
                continue               # removed meanwhile
            out.append(e)
            if e.type == "directory" and depth > 1:
                try:
                    sub = os.open(name, _DIR, dir_fd=d)
                except OSError:
                    continue
                try:
                    self._walk(sub, e.path, depth - 1, out)
                finally:
                    os.close(sub)

    def remove(self, path: str) -> None:
        """A file, a link (itself) or a whole directory; the volume root is refused."""
        parts = parts_of(path)
        if not parts:
            raise InvalidArgument("path '/' is the volume itself", field="path",
                                  fix="delete the volume (Volume.destroy / `dsec volume rm`), or name what it holds")
        with self._dir(parts[:-1], path) as d:
            name = parts[-1]
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(name, dir_fd=d)      # fd-relative: never follows a link inside
                else:
                    os.unlink(name, dir_fd=d)
            except OSError as e:
                raise _refused(path, e) from None
