"""File operations of the agent stub (`agent_stub.AgentStub`), done on the host under a root dir.

The real agent resolves paths inside the container's root; here that root is a plain directory
and a path that leads out of it (`..`, a symlink) is refused with EACCES. UID/GID fields are
ignored: the stub runs as whoever runs the tests. Every function raises `StubError(errno, msg)`
for the dispatcher to answer as an ERROR frame.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from dsec.agent import protocol as P


class StubError(Exception):
    def __init__(self, err: int, message: str):
        super().__init__(err, message)
        self.errno = err
        self.message = message


class Tree:
    """`root` plays the sandbox's `/`; relative paths are relative to `workdir` (absolute)."""

    def __init__(self, root: Path, workdir: str = "/work"):
        self.root = Path(os.path.realpath(root))
        self.workdir = workdir

    def host(self, path: str, *, follow: bool = True) -> Path:
        """The host path of a sandbox path. follow=False keeps the last component unresolved
        (REMOVE and FILE_WRITE act on the entry itself, not where a symlink points)."""
        if not path:
            raise StubError(errno.EINVAL, "empty PATH")
        rel = path if path.startswith("/") else f"{self.workdir}/{path}"
        lexical = self.root / rel.lstrip("/")
        if follow:
            real = Path(os.path.realpath(lexical))
        else:
            real = Path(os.path.realpath(lexical.parent)) / lexical.name
            if lexical.name in ("", ".", ".."):
                real = Path(os.path.realpath(lexical))
        if real != self.root and self.root not in real.parents:
            raise StubError(errno.EACCES, f"{path}: leads outside the sandbox root")
        return real

    def cwd(self, path: str | None) -> Path:
        return self.host(path or self.workdir)


def _fail(path: str, e: OSError) -> StubError:
    err = e.errno or errno.EIO
    return StubError(err, f"{path}: {os.strerror(err)}")


def read(tree: Tree, path: str, maxlen: int) -> bytes:
    host = tree.host(path)
    try:
        st = host.stat()
        if stat.S_ISDIR(st.st_mode):
            raise StubError(errno.EISDIR, f"{path}: is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise StubError(errno.EINVAL, f"{path}: not a regular file")
        if st.st_size > maxlen:
            raise StubError(errno.EFBIG, f"{path}: {st.st_size} bytes > MAXLEN {maxlen}")
        data = host.read_bytes()
    except OSError as e:
        raise _fail(path, e) from None
    if len(data) > maxlen:   # grew while being read
        raise StubError(errno.EFBIG, f"{path}: grew beyond MAXLEN {maxlen}")
    return data


def write(tree: Tree, path: str, data: bytes, mode: int, mkdirs: bool) -> None:
    """Temp file in the same directory, renamed into place (replaces a symlink at PATH)."""
    host = tree.host(path, follow=False)
    try:
        if mkdirs:
            host.parent.mkdir(parents=True, exist_ok=True)
        if host.is_dir() and not host.is_symlink():
            raise StubError(errno.EISDIR, f"{path}: is a directory")
        fd, tmp = tempfile.mkstemp(dir=host.parent, prefix=".dsec-write-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, mode & 0o7777)   # exactly MODE, whatever the umask
            os.replace(tmp, host)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise _fail(path, e) from None


def listing(tree: Tree, path: str) -> bytes:
    """The LISTING payload of a directory."""
    host = tree.host(path)
    out = bytearray()
    try:
        with os.scandir(host) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:   # vanished meanwhile
                    continue
                kind = (0 if stat.S_ISREG(st.st_mode) else 1 if stat.S_ISDIR(st.st_mode)
                        else 2 if stat.S_ISLNK(st.st_mode) else 3)
                name = os.fsencode(entry.name)
                out += P.LISTING_ENTRY.pack(kind, st.st_mode & 0o7777, st.st_size, st.st_mtime_ns, len(name))
                out += name
    except OSError as e:
        raise _fail(path, e) from None
    if len(out) > 8 << 20:
        raise StubError(errno.E2BIG, f"{path}: listing larger than 8 MiB")
    return bytes(out)


def remove(tree: Tree, path: str) -> None:
    """A file, a symlink or an empty directory."""
    host = tree.host(path, follow=False)
    if host == tree.root:
        raise StubError(errno.EBUSY, f"{path}: is the root")
    try:
        if host.is_dir() and not host.is_symlink():
            host.rmdir()
        else:
            host.unlink()
    except OSError as e:
        raise _fail(path, e) from None


def mkdir(tree: Tree, path: str, mode: int) -> None:
    """Creates parents; an existing directory is fine; a new one gets exactly MODE."""
    host = tree.host(path)
    try:
        if host.is_dir():
            return
        host.mkdir(parents=True)
        os.chmod(host, mode & 0o7777)
    except OSError as e:
        raise _fail(path, e) from None
