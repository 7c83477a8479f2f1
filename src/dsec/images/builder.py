"""Turn sources into a root filesystem directory: rootfs tarballs and debootstrap.

All scratch trees live under Paths.home/build/ and are removed with `safe_rmtree`, which
first detaches anything mounted inside them (debootstrap mounts /proc and /sys in its
target, and would leave them behind if it failed half way).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from dsec.config import Paths
from dsec.types import InvalidArgument, Unavailable

from .mounts import detach_all_under, mounts_under
from .progress import Progress, report
from .unpack import ROOTFS_RULES, unpack_beneath

log = logging.getLogger("dsec.images")

DEFAULT_MIRROR = "http://deb.debian.org/debian"
SUITE_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{0,63}$")
PACKAGE_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]{0,127}$")

_COMPRESSORS = [  # magic, name, tar flag, program tar runs
    (b"\x1f\x8b", "gzip", "-z", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd", "--zstd", "zstd"),
    (b"\xfd7zXZ\x00", "xz", "-J", "xz"),
    (b"BZh", "bzip2", "-j", "bzip2"),
]


# ---------------------------------------------------------------------------------------
# Scratch directories
# ---------------------------------------------------------------------------------------


def safe_rmtree(path: Path) -> None:
    """Remove a scratch tree, never following mounts into it (they are detached first)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    detach_all_under(path)
    if mounts_under(path):
        raise Unavailable(f"refusing to delete {path}: something is still mounted inside it",
                          fix=f"unmount what `grep {path} /proc/self/mountinfo` lists")
    shutil.rmtree(path)


@contextmanager
def scratch_dir(paths: Paths, prefix: str) -> Iterator[Path]:
    base = paths.home / "build"
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=base))
    try:
        yield d
    finally:
        try:
            safe_rmtree(d)
        except Exception:
            log.exception("could not clean scratch dir %s", d)


# ---------------------------------------------------------------------------------------
# Tarballs
# ---------------------------------------------------------------------------------------


def _tar_header_ok(block: bytes) -> bool:
    if len(block) < 512 or not any(block):
        return False
    try:
        stored = int(block[148:156].replace(b"\0", b" ").strip() or b"-1", 8)
    except ValueError:
        return False
    calc = sum(block[:148]) + 8 * 0x20 + sum(block[156:512])
    return stored == calc


def _tarball_error(tarball: Path, why: str, fix: str | None = None) -> InvalidArgument:
    return InvalidArgument(
        f"cannot use tarball {tarball}: {why}", field="tarball",
        fix=fix or "pass a complete, readable .tar, .tar.gz or .tar.zst rootfs archive (it must "
                   "list cleanly with `tar -tf FILE`); if it was downloaded, download it again")


def inspect_tarball(tarball: Path) -> tuple[str | None, str | None]:
    """Validate what can be checked up front. Returns (compression name, tar flag)."""
    tarball = Path(tarball)
    if not tarball.exists():
        raise _tarball_error(tarball, "no such file")
    if not tarball.is_file():
        raise _tarball_error(tarball, "not a regular file")
    try:
        with open(tarball, "rb") as f:
            head = f.read(512)
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise _tarball_error(tarball, "the file is empty")
            for magic, name, flag, prog in _COMPRESSORS:
                if head.startswith(magic):
                    if shutil.which(prog) is None:
                        raise Unavailable(f"tarball {tarball} is {name}-compressed but `{prog}` "
                                          f"is not installed", fix=f"apt-get install -y {prog}")
                    return name, flag
            # plain tar: must start with a valid header and end with the end-of-archive
            # marker (two zero blocks); GNU tar itself accepts some truncations silently.
            if not _tar_header_ok(head):
                raise _tarball_error(tarball, "not a tar archive (no valid tar header at the "
                                              "start, and not gzip/zstd/xz/bzip2 compressed)")
            if size % 512:
                raise _tarball_error(tarball, f"truncated: size {size} is not a multiple of 512 "
                                              "bytes")
            f.seek(size - 1024)
            if any(f.read(1024)):
                raise _tarball_error(tarball, "truncated or incomplete: it does not end with the "
                                              "tar end-of-archive marker")
            return None, None
    except PermissionError as e:
        raise _tarball_error(tarball, f"not readable ({e.strerror})") from e
    except OSError as e:
        if isinstance(e, (FileNotFoundError,)):
            raise _tarball_error(tarball, "no such file") from e
        raise _tarball_error(tarball, f"read error: {e.strerror}") from e


def extract_tarball(tarball: Path, dest: Path, *, progress: Progress | None = None) -> None:
    """Extract a rootfs tarball into the (empty) directory `dest` as root, keeping numeric
    owners, modes, device nodes, xattrs and ACLs, with bsdtar chrooted into `dest` (unpack.py:
    no member or link resolves outside it; '..' names are refused). Any archive error,
    including a truncated or corrupt one, raises InvalidArgument(field='tarball')."""
    tarball = Path(tarball)
    inspect_tarball(tarball)
    try:
        unpack_beneath(tarball, dest, field="tarball", what=f"tarball {tarball}", rules=ROOTFS_RULES,
                       progress=progress)
    except InvalidArgument as e:
        why = e.message
        if "corrupt or truncated" in why or "Truncated" in why or "unexpected end" in why.lower():
            why = f"truncated or corrupt archive ({why})"
        raise _tarball_error(tarball, why, fix=e.fix) from None


def create_tarball(src: Path, out: Path) -> None:
    """Write `src` as a tarball at `out` (atomically), zstd-compressed when zstd exists.
    POSIX format keeps nanosecond mtimes and xattrs, so extracting it gives back a tree
    that builds the byte-identical EROFS image."""
    tmp = out.with_name(f".tmp-{secrets.token_hex(6)}-{out.name}")
    comp = ["--zstd"] if shutil.which("zstd") else ["-z"]
    cmd = ["tar", "-c", *comp, "-f", str(tmp), "-C", str(src), "--numeric-owner", "--xattrs",
           "--xattrs-include=*", "--acls", "--format=posix", "--sort=name", "."]
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=dict(os.environ, LC_ALL="C"))
        if proc.returncode != 0:
            raise Unavailable(f"could not write {out}: {proc.stderr.decode(errors='replace')[-500:]}",
                              fix=f"check free space under {out.parent}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------
# debootstrap
# ---------------------------------------------------------------------------------------

_PHASES = [("I: Retrieving", 0.1), ("I: Validating", 0.3), ("I: Extracting", 0.4),
           ("I: Installing", 0.5), ("I: Unpacking", 0.6), ("I: Configuring", 0.8),
           ("I: Base system installed", 1.0)]


def check_debootstrap_args(suite: str, include: Sequence[str]) -> list[str]:
    if not isinstance(suite, str) or not SUITE_RE.match(suite):
        raise InvalidArgument(f"suite {suite!r} is not a Debian suite name", field="suite",
                              fix="use a codename such as 'bookworm' or 'trixie'")
    if isinstance(include, str):
        include = [p for p in include.replace(",", " ").split() if p]
    pkgs = sorted(set(include))
    for p in pkgs:
        if not PACKAGE_RE.match(p):
            raise InvalidArgument(f"{p!r} is not a Debian package name", field="include",
                                  fix="use package names such as 'python3' or 'git'")
    return pkgs


def debootstrap(dest: Path, suite: str, include: Sequence[str] = (), *, mirror: str | None = None,
                variant: str = "minbase", progress: Progress | None = None) -> None:
    """`debootstrap --variant=minbase [--include=...] SUITE DEST MIRROR`, then drop apt's
    package cache and lists and the host-specific files debootstrap copies in."""
    pkgs = check_debootstrap_args(suite, include)
    mirror = mirror or DEFAULT_MIRROR
    exe = shutil.which("debootstrap") or (
        "/usr/sbin/debootstrap" if os.path.exists("/usr/sbin/debootstrap") else None)
    if exe is None:
        raise Unavailable("debootstrap is not installed on this node",
                          fix="apt-get install -y debootstrap")
    cmd = [exe, f"--variant={variant}"]
    if pkgs:
        cmd.append(f"--include={','.join(pkgs)}")
    cmd += [suite, str(dest), mirror]
    report(progress, f"debootstrap {suite} ({', '.join(pkgs) or 'no extra packages'}) from {mirror}",
           0.0, level=logging.INFO)
    t0 = time.monotonic()
    tail: deque[str] = deque(maxlen=40)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C")
    fraction = 0.0
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, text=True, errors="replace")
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = line.rstrip()
            if not line:
                continue
            tail.append(line)
            for prefix, f in _PHASES:
                if line.startswith(prefix):
                    fraction = max(fraction, f)
            report(progress, line, fraction)
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        detach_all_under(dest)
        raise
    detach_all_under(dest)  # debootstrap's /proc, /sys if it stopped half way
    if rc != 0:
        text = "\n".join(tail)
        errors = [ln for ln in tail if ln.startswith("E:")] or list(tail)[-5:]
        msg = f"debootstrap {suite} failed (exit {rc}): {' | '.join(errors)}"
        if "Couldn't find these debs" in text or "Couldn't find package" in text:
            raise InvalidArgument(msg, field="include",
                                  fix=f"check the package names exist in Debian {suite}")
        if "Failed getting release file" in text or "No such script" in text or \
                "Invalid Release file" in text:
            raise InvalidArgument(msg, field="suite",
                                  fix=f"check the suite exists on {mirror} and the mirror is "
                                      "reachable (set DSEC_DEBIAN_MIRROR to use another one)")
        raise Unavailable(msg, fix=f"check network access to {mirror} (or set DSEC_DEBIAN_MIRROR) "
                                   "and free disk space, then retry")
    _clean_debootstrap_tree(dest)
    report(progress, f"debootstrap {suite} done in {time.monotonic() - t0:.1f}s", 1.0,
           level=logging.INFO)


def _clean_debootstrap_tree(root: Path) -> None:
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin",
                    "var/lib/apt/lists/*_*", "var/log/bootstrap.log"):
        for p in root.glob(pattern):
            if p.is_file() or p.is_symlink():
                p.unlink()
    etc = root / "etc"
    # debootstrap copies the build host's resolver and hostname; the sandbox runtime
    # provides its own. Keep the files (some tools expect them) but not the host's data.
    for name, content in (("resolv.conf", ""), ("hostname", "sandbox\n")):
        p = etc / name
        if p.is_symlink():
            p.unlink()
        st = p.stat() if p.exists() else None
        p.write_text(content)
        if st is not None:
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def debootstrap_cache_key(suite: str, include: Sequence[str], variant: str = "minbase") -> str:
    pkgs = check_debootstrap_args(suite, include)
    blob = json.dumps({"suite": suite, "variant": variant, "include": pkgs}, sort_keys=True)
    return f"debootstrap-{suite}-{variant}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def debootstrap_cached(paths: Paths, dest: Path, suite: str, include: Sequence[str] = (), *,
                       mirror: str | None = None, cache: bool = True,
                       progress: Progress | None = None) -> bool:
    """Fill `dest` with a debootstrap tree, from the tarball cache under Paths.home/cache/
    when present (keyed by suite + packages), else by running debootstrap and caching the
    result. Returns True when the cache was used."""
    key = debootstrap_cache_key(suite, include)
    cache_dir = paths.home / "cache"
    cached = [cache_dir / f"{key}.tar.zst", cache_dir / f"{key}.tar.gz"]
    if cache:
        for tarball in cached:
            if tarball.is_file():
                try:
                    report(progress, f"using cached debootstrap tree {tarball.name}", None,
                           level=logging.INFO)
                    extract_tarball(tarball, dest, progress=progress)
                    return True
                except InvalidArgument as e:
                    log.warning("cached debootstrap tarball %s is unusable (%s); rebuilding",
                                tarball, e.message)
                    tarball.unlink(missing_ok=True)
                    safe_rmtree(dest)
    if dest.exists() and any(dest.iterdir()):
        safe_rmtree(dest)
    debootstrap(dest, suite, include, mirror=mirror, progress=progress)
    if cache:
        cache_dir.mkdir(parents=True, exist_ok=True)
        out = cached[0] if shutil.which("zstd") else cached[1]
        t0 = time.monotonic()
        create_tarball(dest, out)
        log.info("cached debootstrap tree as %s (%d bytes, %.1fs)", out, out.stat().st_size,
                 time.monotonic() - t0)
    return False


# ---------------------------------------------------------------------------------------
# Sparse files (pack_diff): what a tree holds, holes kept when copying
# ---------------------------------------------------------------------------------------


@dataclass
class TreeSize:
    """Regular files of a tree, each inode once: `apparent` bytes (holes read as zeros, what
    a reader or mkfs sees), `data` bytes really allocated, whether any file has holes, and
    the biggest files (path, apparent bytes), for messages."""

    apparent: int = 0
    data: int = 0
    sparse: bool = False
    biggest: list[tuple[str, int]] = field(default_factory=list)


def has_holes(path: str, size: int) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) < size
    except OSError:
        return False
    finally:
        os.close(fd)


def tree_size(root: Path, skip: Callable[[str], bool] = lambda rel: False) -> TreeSize:
    """Walk `root` (no symlinks followed), leaving out relative paths `skip` says to."""
    out = TreeSize()
    seen: set[tuple[int, int]] = set()
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for e in it:
                r = f"{rel}/{e.name}" if rel else e.name
                if skip(r):
                    continue
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(r)
                    continue
                if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                out.apparent += st.st_size
                out.data += min(st.st_blocks * 512, st.st_size)
                if st.st_blocks * 512 < st.st_size and not out.sparse:
                    out.sparse = has_holes(e.path, st.st_size)   # st_blocks alone: inline/compressed too
                out.biggest = sorted([*out.biggest, ("/" + r, st.st_size)], key=lambda x: -x[1])[:3]
    return out


def copy_keep_holes(src_fd: int, dst_fd: int, size: int) -> int:
    """Copy a regular file's data extents (SEEK_DATA/SEEK_HOLE) and leave its holes holes:
    a 1 GiB `truncate` writes nothing. Returns the bytes copied."""
    copied, pos = 0, 0
    while pos < size:
        try:
            start = os.lseek(src_fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:     # only a hole is left
                break
            raise
        end = min(os.lseek(src_fd, start, os.SEEK_HOLE), size)
        os.lseek(dst_fd, start, os.SEEK_SET)
        while start < end:
            n = os.sendfile(dst_fd, src_fd, start, min(end - start, 1 << 30))
            if n == 0:
                break
            start += n
            copied += n
        pos = end
    os.ftruncate(dst_fd, size)
    return copied
