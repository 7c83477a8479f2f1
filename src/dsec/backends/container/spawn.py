"""Run a helper process (nsexec + crun, `crun delete`) and wait for its exit on the event loop
through a pidfd.

asyncio's subprocesses on Python 3.11 wait with the default ThreadedChildWatcher: a new thread
per child that blocks in waitpid, plus a transport and protocol objects per process. A create
spawns one such chain and a stop one `crun delete`; py-spy put the asyncio subprocess machinery
at 27% of the edge's create-path samples (D74). Here the child is a plain subprocess.Popen
and its pidfd (Linux 5.3+) is one more reader on the loop, reaped in the reader's callback,
so a cancelled waiter leaves no zombie behind either.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence


async def run_to_exit(argv: Sequence[str], *, stdout: int, stderr: int, pass_fds: Sequence[int] = (),
                      umask: int = -1) -> int:
    """Start argv (stdin /dev/null) and return its exit status; stdout/stderr are fds or
    subprocess.DEVNULL. Blocks the loop only for the fork+exec, as asyncio's spawn does."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            pass_fds=tuple(pass_fds), umask=umask)
    try:
        pidfd = os.pidfd_open(proc.pid)
    except OSError:             # no pidfds (old kernel): a thread waits, as asyncio's watcher would
        return await asyncio.to_thread(proc.wait)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()

    def exited() -> None:
        # readable once the child has exited; reaped here even if the waiter was cancelled
        loop.remove_reader(pidfd)
        os.close(pidfd)
        rc = proc.wait()
        if not done.done():
            done.set_result(rc)
    loop.add_reader(pidfd, exited)
    return await asyncio.shield(done)
