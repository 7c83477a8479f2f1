"""Is a VM's QEMU still running? Asked of every running VM on every reaper tick (the edge's
liveness check, edge/reaping.py), so it must not cost file reads per VM: a pidfd per QEMU,
opened once, answers with one poll() (readable once the process has exited).

The first question about a VM reads its pid file and checks /proc once (the pid is that VM's
QEMU, not a reused pid: `qemu.pid_alive`); the pidfd then pins that very process, so a later
pid reuse cannot fool it. The driver forgets a VM's pidfd whenever it starts a new QEMU for it
or stops it (launch, park, destroy).
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable

from dsec.backends.vm.qemu import pid_alive


class PidWatch:
    def __init__(self) -> None:
        self._fds: dict[str, tuple[int, int]] = {}     # VM name -> (pid, pidfd)

    def alive(self, name: str, read_pid: Callable[[], int | None]) -> bool:
        held = self._fds.get(name)
        if held is not None:
            if not _exited(held[1]):
                return True
            self.forget(name)
            return False
        pid = read_pid()
        if pid is None:
            return False
        try:
            fd = os.pidfd_open(pid)
        except OSError:          # gone already (ESRCH), or no pidfds here: the /proc check alone
            return pid_alive(pid, name)
        # checked after the open: the pidfd now holds the process the check saw
        if not pid_alive(pid, name) or _exited(fd):
            os.close(fd)
            return False
        self._fds[name] = (pid, fd)
        return True

    def forget(self, name: str) -> None:
        held = self._fds.pop(name, None)
        if held is not None:
            os.close(held[1])

    def __len__(self) -> int:
        return len(self._fds)


def _exited(pidfd: int) -> bool:
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))
