"""Replace the lxcfs binds in running sandboxes' mount namespaces (after the daemon died: its
binds read ENOTCONN for good). Run as its own process (`python -m` this module): setns(2)
into a mount namespace needs a single-threaded caller, and the edge has threads.

Per sandbox: open_tree(OPEN_TREE_CLONE) of each view file on the host, setns into the
sandbox's mount namespace, detach the dead bind at the same path, move_mount the fresh one
there, setns back. With no view (no daemon would start) the dead binds are only detached:
the sandbox reads the host's figures, never an error.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

from dsec.backends.container.lxcfs import VIEW_FILES

CLONE_NEWNS = 0x00020000
AT_FDCWD = -100
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
MOVE_MOUNT_F_EMPTY_PATH = 0x00000004
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
SYS_OPEN_TREE = 428    # the same number on every architecture (added after the table unification)
SYS_MOVE_MOUNT = 429

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> int:
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return rc


def _open_tree(path: Path) -> int:
    return _check(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC),
                  f"open_tree {path}")


def _move_mount(fd: int, target: str) -> None:
    _check(_libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
           f"move_mount {target}")


def _setns(fd: int) -> None:
    _check(_libc.setns(fd, CLONE_NEWNS), "setns")


def _in_cgroup(pid: int, rel: str) -> bool:
    """The pid is still a process of the sandbox's cgroup (not a reused pid)."""
    try:
        return any(line.endswith(":" + rel) for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    except OSError:
        return False


def rebind_one(pid: int, rel: str, view: Path | None, host_ns: int) -> None:
    ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        # checked after the fd pins the namespace: a pid reused since is never entered, and
        # never the host's own namespace
        if not _in_cgroup(pid, rel) or os.fstat(ns).st_ino == os.fstat(host_ns).st_ino:
            return
        clones = [_open_tree(view / f) for f in VIEW_FILES] if view is not None else []
        try:
            _setns(ns)
            try:
                for i, f in enumerate(VIEW_FILES):
                    target = "/" + f
                    _libc.umount2(target.encode(), MNT_DETACH | UMOUNT_NOFOLLOW)   # EINVAL: none there
                    if clones:
                        _move_mount(clones[i], target)
            finally:
                _setns(host_ns)
        finally:
            for fd in clones:
                os.close(fd)
    finally:
        os.close(ns)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--view", type=Path, help="the lxcfs mountpoint; absent: only detach the binds")
    p.add_argument("sandboxes", nargs="*", help="PID:CGROUP of each sandbox's init")
    a = p.parse_args(argv)
    host_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    failed = 0
    for item in a.sandboxes:
        pid, _, rel = item.partition(":")
        try:
            rebind_one(int(pid), rel, a.view, host_ns)
        except (OSError, ValueError) as e:        # gone meanwhile, or one that will not take it
            failed += 1
            print(f"{item}: {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
