"""The VM driver's is_running (issue 31: a clone burst with hundreds alive): one pidfd per QEMU,
so the reaper's liveness check of every running VM reads no file after the first question.
Real processes stand in for QEMUs (pid_alive matches `dsec-NAME,` in the command line)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from dsec.backends.vm.pidwatch import PidWatch


def _fake_qemu(name: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-name", f"dsec-{name},debug-threads=on"])
    for _ in range(5000):     # Popen may return before the exec (the command line is empty until then)
        if f"dsec-{name},".encode() in Path(f"/proc/{p.pid}/cmdline").read_bytes():
            return p
        time.sleep(0.001)
    raise AssertionError("the stand-in QEMU did not start")


def test_a_running_qemu_is_read_once_then_watched_by_its_pidfd() -> None:
    p = _fake_qemu("vm1")
    w = PidWatch()
    reads = []

    def read_pid() -> int:
        reads.append(1)
        return p.pid
    try:
        assert all(w.alive("vm1", read_pid) for _ in range(50))
        assert len(reads) == 1           # the old code read the pid file, cmdline and stat every time
        assert len(w) == 1
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert not w.alive("vm1", read_pid)   # exited: seen through the pidfd
    assert len(w) == 0 and len(reads) == 1


def test_a_pid_that_is_not_this_vms_qemu_is_not_running() -> None:
    other = _fake_qemu("vm-other")
    w = PidWatch()
    try:
        assert not w.alive("vm1", lambda: other.pid)      # a reused pid: another VM's QEMU
        assert not w.alive("vm1", lambda: None)           # no pid file
        assert len(w) == 0
    finally:
        other.kill()
        other.wait()


def test_forget_asks_the_pid_again_after_a_new_qemu() -> None:
    a, b = _fake_qemu("vm1"), _fake_qemu("vm1")
    w = PidWatch()
    try:
        assert w.alive("vm1", lambda: a.pid)
        a.kill()
        a.wait()
        w.forget("vm1")                                  # the driver launched a new QEMU for vm1
        assert w.alive("vm1", lambda: b.pid)
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
