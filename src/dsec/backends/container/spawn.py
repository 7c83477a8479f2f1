"""Run a helper process (nsexec + crun, `crun delete`) and wait for its exit on the event loop
through a pidfd.

asyncio's subprocesses on Python 3.11 wait with the default ThreadedChildWatcher: a new thread
per child that blocks in waitpid, plus a transport and protocol objects per process. A create
spawns one such chain and a stop one `crun delete`; py-spy put the asyncio subprocess machinery
at 27% of the edge's create-path samples (D74). Here the child's pidfd (Linux 5.3+) is one more
reader on the loop, reaped in the reader's callback, so a cancelled waiter leaves no zombie
behind either.

The spawn itself (D97): Python 3.11's subprocess vforks holding the GIL until the child has
exec'd, so every thread of the server, the event loop first, stops for as long as the child
takes to reach its exec; on a busy node that is the child's wait for a CPU (py-spy: a third of
the server's GIL time during creates at 8 in flight, ~1.6 ms a create). glibc's posix_spawn
called through ctypes (which drops the GIL around a foreign call) from a small thread pool
does the same clone-and-exec while the loop and the other threads run on. The child gets what
Popen gave it: stdin /dev/null, the given stdout/stderr, the pass_fds and nothing else (every
other fd closed: closefrom), default SIGPIPE/SIGXFSZ and an empty signal mask. A umask cannot
be set through posix_spawn: the one caller that needs one (nsexec) sets its own. Where glibc
lacks what this needs (posix_spawn_file_actions_addclosefrom_np, 2.34+), Popen as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import fcntl
import os
import signal
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

POSIX_SPAWN_SETSIGDEF = 0x04
POSIX_SPAWN_SETSIGMASK = 0x08
_ACTIONS_SIZE = 256          # posix_spawn_file_actions_t is 80 bytes on x86_64/aarch64 glibc
_ATTR_SIZE = 1024            # posix_spawnattr_t 336
_SIGSET_SIZE = 128

# a few threads of its own: a spawn never queues behind the default executor's file work
_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsec-spawn")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc if hasattr(libc, "posix_spawn_file_actions_addclosefrom_np") else None   # glibc 2.34+
    except OSError:
        return None


_LIBC = _libc()


def posix_spawn_available() -> bool:
    return _LIBC is not None


def _spawn(argv: Sequence[str], stdout: int, stderr: int, pass_fds: Sequence[int]) -> int:
    """posix_spawnp of argv; its pid. Runs in a thread: ctypes releases the GIL for the call."""
    libc = _LIBC
    assert libc is not None
    actions = ctypes.create_string_buffer(_ACTIONS_SIZE)
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    sigs = ctypes.create_string_buffer(_SIGSET_SIZE)
    opened: list[int] = []

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(rc, f"{what}: {os.strerror(rc)}")
    try:
        check(libc.posix_spawn_file_actions_init(actions), "posix_spawn_file_actions_init")
        check(libc.posix_spawnattr_init(attr), "posix_spawnattr_init")
        try:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            opened.append(null)
            # sources above every target, so no dup2 below overwrites one still to be read
            low = 3 + len(pass_fds)

            def above(fd: int) -> int:
                fd = null if fd == subprocess.DEVNULL else fd
                d = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, low)
                opened.append(d)
                return d
            srcs = [(above(null), 0), (above(stdout), 1), (above(stderr), 2)]
            srcs += [(above(fd), 3 + i) for i, fd in enumerate(pass_fds)]
            for src, target in srcs:      # dup2 to another number: the copy is inherited
                check(libc.posix_spawn_file_actions_adddup2(actions, src, target), "adddup2")
            check(libc.posix_spawn_file_actions_addclosefrom_np(actions, low), "addclosefrom_np")
            libc.sigemptyset(sigs)
            check(libc.posix_spawnattr_setsigmask(attr, sigs), "setsigmask")
            for s in (signal.SIGPIPE, signal.SIGXFSZ):     # what Popen(restore_signals=True) resets
                libc.sigaddset(sigs, int(s))
            check(libc.posix_spawnattr_setsigdefault(attr, sigs), "setsigdefault")
            check(libc.posix_spawnattr_setflags(attr, ctypes.c_short(POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK)),
                  "setflags")
            args = (ctypes.c_char_p * (len(argv) + 1))(*[os.fsencode(a) for a in argv], None)
            env = [os.fsencode(f"{k}={v}") for k, v in os.environ.items()]
            envp = (ctypes.c_char_p * (len(env) + 1))(*env, None)
            pid = ctypes.c_int(0)
            rc = libc.posix_spawnp(ctypes.byref(pid), os.fsencode(argv[0]), actions, attr, args, envp)
            if rc != 0:
                raise OSError(rc, f"{os.strerror(rc)}: {argv[0]!r}", argv[0])
            return pid.value
        finally:
            libc.posix_spawn_file_actions_destroy(actions)
            libc.posix_spawnattr_destroy(attr)
    finally:
        for fd in opened:
            os.close(fd)


async def run_to_exit(argv: Sequence[str], *, stdout: int, stderr: int, pass_fds: Sequence[int] = ()) -> int:
    """Start argv (stdin /dev/null) and return its exit status; stdout/stderr are fds or
    subprocess.DEVNULL. pass_fds are the child's fds 3, 4, ... in that order (argv names them
    so); every other fd of the server is closed in the child."""
    loop = asyncio.get_running_loop()
    if _LIBC is not None:
        pid = await loop.run_in_executor(_pool, _spawn, list(argv), stdout, stderr, tuple(pass_fds))
        proc = None
    else:
        pid, proc = _popen(argv, stdout, stderr, pass_fds)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:             # no pidfds (old kernel): a thread waits, as asyncio's watcher would
        return await asyncio.to_thread(_wait, pid)
    done: asyncio.Future[int] = loop.create_future()

    def exited() -> None:
        # readable once the child has exited; reaped here even if the waiter was cancelled
        loop.remove_reader(pidfd)
        os.close(pidfd)
        rc = proc.wait() if proc is not None else _wait(pid)
        if not done.done():
            done.set_result(rc)
    loop.add_reader(pidfd, exited)
    return await asyncio.shield(done)


def _popen(argv: Sequence[str], stdout: int, stderr: int, pass_fds: Sequence[int]) -> tuple[int, subprocess.Popen]:
    """The fallback: Popen with the pass_fds moved to 3, 4, ... as _spawn places them."""
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + len(pass_fds)) for fd in pass_fds]

    def place() -> None:       # in the child, before exec (Popen then runs without vfork)
        for i, fd in enumerate(moved):
            os.dup2(fd, 3 + i)
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                pass_fds=tuple(range(3, 3 + len(moved))), preexec_fn=place if moved else None)  # noqa: PLW1509 - old glibc only
    finally:
        for fd in moved:
            os.close(fd)
    return proc.pid, proc


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
