"""Which process serves a DSEC_HOME: a lock file that is never removed.

`server.pid` was the only record, and it could vanish under a live server (a second `dsec up`
on the same home wrote its own pid there, failed to bind, and removed the file on its way
out), after which `dsec down` answered "not running". Now the serving process holds an
exclusive flock on `server.lock` (its pid written inside) for as long as it lives: a second
server on the home is refused before it touches anything, and `dsec down` finds the holder
even when server.pid is gone. server.pid is still written for tools that read it, and removed
only by the process whose pid it holds.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from dsec.config import Paths
from dsec.types import Conflict


def _lock_file(paths: Paths) -> str:
    return str(paths.home / "server.lock")


def serving_pid(paths: Paths) -> int | None:
    """The pid of the live server of this home, or None when no process holds its lock."""
    try:
        fd = os.open(_lock_file(paths), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


@contextmanager
def hold_server_lock(paths: Paths) -> Iterator[None]:
    """Be the one server of this home until the block ends (or the process dies)."""
    fd = os.open(_lock_file(paths), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise Conflict(f"another dsec server (pid {other or '?'}) already serves {paths.home}",
                           field="DSEC_HOME", fix="use that server (`dsec down` stops it), or give this one "
                                                  "its own DSEC_HOME") from None
        me = str(os.getpid()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, me, 0)
        paths.server_pid.write_text(me.decode())
        try:
            yield
        finally:
            try:
                if paths.server_pid.read_text().strip() == me.decode():
                    paths.server_pid.unlink()
            except FileNotFoundError:
                pass
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
