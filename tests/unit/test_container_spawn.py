"""The container driver's helper processes (nsexec + crun at create, crun delete at stop) are
spawned with posix_spawn from a thread, without the GIL (D97), and waited for through a pidfd on
the event loop (backends/container/spawn.py): no waiter thread per child, the exit status, the
pass_fds at 3, 4, ..., no other fd of the server, default SIGPIPE, and no zombie when the waiter
is cancelled."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from dsec.backends.container import driver, spawn
from dsec.backends.container.spawn import run_to_exit

PY = sys.executable


async def test_exit_status_and_fds(tmp_path):
    assert await run_to_exit([PY, "-c", "raise SystemExit(3)"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) == 3
    r, w = os.pipe()
    r2, w2 = os.pipe()
    leak = os.open(os.devnull, os.O_RDONLY)
    os.set_inheritable(leak, True)          # even an inheritable fd stays out of the child
    out = tmp_path / "out"
    code = ("import os; os.write(3, b'fd'); os.write(4, b'f2'); "
            "print(sorted(int(x) for x in os.listdir('/proc/self/fd')), os.path.realpath('/proc/self/fd/0'))")
    f = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    rc = await run_to_exit([PY, "-c", code], stdout=f, stderr=f, pass_fds=(w, w2))
    os.close(f)
    for fd in (w, w2, leak):
        os.close(fd)
    fds, stdin = out.read_text().strip().rsplit(" ", 1)
    assert rc == 0 and os.read(r, 2) == b"fd" and os.read(r2, 2) == b"f2"
    # 0-2, the two passed fds at 3 and 4, and the one listdir itself opens
    assert fds.startswith("[0, 1, 2, 3, 4, 5]") and len(eval(fds)) == 6, fds
    assert stdin == "/dev/null"
    os.close(r)
    os.close(r2)


async def test_signals_as_popen_left_them(tmp_path):
    """SIGPIPE back to its default (Python ignores it; crun must not inherit that), nothing blocked."""
    out = tmp_path / "status"
    f = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    assert await run_to_exit(["cat", "/proc/self/status"], stdout=f, stderr=f) == 0
    os.close(f)
    st = dict(line.split(":\t", 1) for line in out.read_text().splitlines() if ":\t" in line)
    assert int(st["SigIgn"], 16) & (1 << (13 - 1)) == 0 and int(st["SigBlk"], 16) == 0


async def test_posix_spawn_is_what_runs_here():
    # glibc 2.34+ (Debian 12: 2.36): the spawn without the GIL; the Popen fallback is for older ones
    assert spawn.posix_spawn_available()


async def test_a_missing_program_is_an_oserror():
    with pytest.raises(OSError) as e:
        await run_to_exit(["/nonexistent/dsec-nothing"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert e.value.errno == 2


async def test_no_waiter_thread_per_child():
    # Python 3.11's asyncio subprocess starts a waitpid thread per child (ThreadedChildWatcher)
    before = {t.name for t in threading.enumerate()}
    task = asyncio.create_task(run_to_exit([PY, "-c", "import time; time.sleep(0.5)"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    await asyncio.sleep(0.1)
    assert {t.name for t in threading.enumerate()} - before == set()
    assert await task == 0


async def test_a_cancelled_wait_still_reaps_the_child():
    r, w = os.pipe()
    task = asyncio.create_task(run_to_exit([PY, "-c", ("import os, time; os.write(3, str(os.getpid()).encode()); "
                                                        "time.sleep(0.3)")],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(w,)))
    kid = int(await asyncio.to_thread(os.read, r, 32))    # the child's own pid, not any child of pytest's
    os.close(w)
    os.close(r)
    assert _exists(kid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 30
    while _exists(kid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)     # the loop's reader reaps it once it exits
    assert not _exists(kid), "child left as a zombie"


def test_the_create_path_uses_it():
    # the start of every container (nsexec + crun run) goes through run_to_exit, not asyncio's spawn
    assert driver.run_to_exit is run_to_exit
    src = open(driver.__file__).read()
    start = src.index("async def _run_crun")
    body = src[start:src.index("\n    async def ", start + 1)]
    assert "run_to_exit(" in body and "create_subprocess_exec" not in body
    # and the stop's `crun delete` (D97)
    start = src.index("async def _crun_delete")
    body = src[start:src.index("\n    def ", start + 1)]
    assert "run_to_exit(" in body and "create_subprocess_exec" not in body


def _ppid(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _exists(pid: int) -> bool:
    return _ppid(pid) != -1
