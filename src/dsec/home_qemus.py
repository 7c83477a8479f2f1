"""The QEMU processes started from one DSEC_HOME, found by their command lines (every one names
files under its home: disks, sockets, RAM), whatever state the server that started them left.
No QMP import: usable where the vm extra is not installed (cluster clean-up, test teardown)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def qemu_pids_of(home: Path) -> list[int]:
    """Pids of the QEMUs whose argv names a file under `home` (sandboxes and templates alike)."""
    under = str(home).rstrip("/").encode() + b"/"
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"qemu-system-x86_64") and any(under in a for a in argv):
            pids.append(int(p.name))
    return pids


def kill_qemus_of(home: Path) -> list[int]:
    """SIGKILL every QEMU of `home`; the pids that were still there to kill."""
    killed = []
    for pid in qemu_pids_of(home):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed
