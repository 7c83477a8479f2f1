"""Named, versioned layers (workspaces, toolkits) and the trees they are built from.

A layer NAME@VERSION is registered like an image (kind='layer'): an ordered list of
content-addressed EROFS layers. Sources: a directory, a tarball, a git checkout
(`git archive`), or a sandbox's overlay upper dir (pack_diff).

pack_diff copies the upper dir into a scratch tree, keeping what makes it a valid *lower*
layer: whiteouts (char device 0/0), `trusted.overlay.opaque` (and the xattr-whiteout forms
`trusted.overlay.whiteout(s)`), owners, modes, mtimes, xattrs and hard links. Other
`trusted.overlay.*` xattrs (origin, impure, nlink, ...) describe the sandbox's own overlay
and are dropped. mkfs.erofs keeps device nodes and trusted.* xattrs, and overlayfs honours
whiteouts and opaque dirs in lower layers, so the layer replays deletions when stacked.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from dsec.types import InvalidArgument, Unavailable

from .builder import copy_keep_holes

LAYER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,100}@[A-Za-z0-9._+-]{1,26}$")
KEEP_OVERLAY_XATTRS = {"trusted.overlay.opaque", "trusted.overlay.whiteout",
                       "trusted.overlay.whiteouts"}


def check_layer_name(name: str, field: str = "name") -> str:
    if not isinstance(name, str) or not LAYER_NAME_RE.match(name):
        raise InvalidArgument(f"layer name {name!r} is not NAME@VERSION", field=field,
                              fix="use e.g. 'django-15388@v2' or 'harness@7' (letters, digits, "
                                  "'._:+-', then '@' and a version)")
    return name


def _scrubbed(rel: str, patterns: Iterable[str]) -> bool:
    path = "/" + rel
    return any(fnmatch.fnmatchcase(path, p.rstrip("/") or "/") for p in patterns)


def _copy_xattrs(src: str, dst: str) -> None:
    try:
        names = os.listxattr(src, follow_symlinks=False)
    except OSError:
        return
    for n in names:
        if n.startswith("trusted.overlay."):
            if n == "trusted.overlay.metacopy":
                raise Unavailable(f"{src} is an overlay metacopy file (its data is in a lower "
                                  "layer); pack_diff cannot pack it", field=None,
                                  fix="mount sandbox overlays without metacopy=on")
            if n not in KEEP_OVERLAY_XATTRS:
                continue
        try:
            os.setxattr(dst, n, os.getxattr(src, n, follow_symlinks=False),
                        follow_symlinks=False)
        except OSError as e:
            if not stat.S_ISLNK(os.lstat(dst).st_mode):
                raise Unavailable(f"could not copy xattr {n} of {src}: {e.strerror}",
                                  fix="the scratch filesystem must support trusted.* xattrs "
                                      "(run as root on ext4/xfs/tmpfs)") from e


def copy_upper(upper: Path, dest: Path, scrub: Iterable[str] = (),
               map_id: Callable[[int], int] | None = None) -> int:
    """Copy an overlay upper dir to `dest` (which must not exist), leaving out scrubbed
    paths. Returns the number of entries copied (0 besides the root: nothing changed).
    `map_id` turns the host uids/gids stored in the upper into the ids the layer keeps (a
    sandbox with its own user namespace writes shifted host ids: see
    backends/container/idmap.py); None keeps them."""
    ids = map_id or (lambda i: i)
    scrub = list(scrub)
    upper, dest = Path(upper), Path(dest)
    links: dict[tuple[int, int], str] = {}
    count = 0
    dirs: list[tuple[str, os.stat_result]] = []

    def one(src: str, dst: str, st: os.stat_result) -> None:
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            os.mkdir(dst, 0o700)
        elif st.st_nlink > 1 and not stat.S_ISDIR(mode) and (st.st_dev, st.st_ino) in links:
            os.link(links[(st.st_dev, st.st_ino)], dst)
            return
        elif stat.S_ISREG(mode):
            with open(src, "rb") as fi, open(dst, "xb") as fo:
                copy_keep_holes(fi.fileno(), fo.fileno(), st.st_size)   # a sparse file stays sparse
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            if stat.S_ISSOCK(mode):
                return                 # a unix socket is not content
            os.mknod(dst, mode, st.st_rdev)
        else:
            return
        if st.st_nlink > 1 and not stat.S_ISDIR(mode):
            links[(st.st_dev, st.st_ino)] = dst
        os.lchown(dst, ids(st.st_uid), ids(st.st_gid))
        _copy_xattrs(src, dst)
        if not stat.S_ISLNK(mode):
            os.chmod(dst, stat.S_IMODE(mode))
        if stat.S_ISDIR(mode):
            dirs.append((dst, st))     # dir mtimes are set last, after their children
        else:
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)

    root_st = os.lstat(upper)
    one(str(upper), str(dest), root_st)
    stack = [""]
    while stack:
        rel = stack.pop()
        for name in sorted(os.listdir(upper / rel if rel else upper)):
            r = f"{rel}/{name}" if rel else name
            if _scrubbed(r, scrub):
                continue
            st = os.lstat(upper / r)
            one(str(upper / r), str(dest / r), st)
            count += 1
            if stat.S_ISDIR(st.st_mode):
                stack.append(r)
    for d, st in reversed(dirs):
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
    return count


def git_archive(repo: Path, out_tar: Path, rev: str = "HEAD", prefix: str = "") -> None:
    """`git archive` REV of the checkout at `repo` into `out_tar` (plain tar)."""
    if not (Path(repo) / ".git").exists() and not (Path(repo) / "HEAD").exists():
        raise InvalidArgument(f"{repo} is not a git checkout", field="from_git",
                              fix="pass the root of a git working tree (or a bare repository)")
    if rev.startswith("-") or "\0" in rev:
        raise InvalidArgument(f"bad git revision {rev!r}", field="rev", fix="use e.g. HEAD or a tag")
    prefix = prefix.strip("/")
    cmd = ["git", "-c", f"safe.directory={Path(repo).resolve()}", "-C", str(repo), "archive",
           "--format=tar", f"--output={out_tar}"]
    if prefix:
        cmd.append(f"--prefix={prefix}/")
    cmd += [rev, "--"]
    with tempfile.TemporaryFile() as errf:
        rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=errf).returncode
        errf.seek(0)
        err = errf.read().decode(errors="replace").strip()
    if rc != 0:
        raise InvalidArgument(f"git archive of {repo} at {rev!r} failed: {err[-1000:]}",
                              field="rev", fix="check the revision exists: git -C REPO rev-parse REV")


def chown_tree(root: Path, uid: int, gid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.lchown(dirpath, uid, gid)
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, gid)


def parse_owner(owner: str | None) -> tuple[int, int] | None:
    if owner is None:
        return None
    m = re.match(r"^(\d{1,9})(?::(\d{1,9}))?$", owner)
    if not m:
        raise InvalidArgument(f"bad owner {owner!r}", field="chown", fix="use UID[:GID], e.g. 1000:1000")
    uid = int(m.group(1))
    return uid, int(m.group(2)) if m.group(2) else uid
