"""The container driver's helper processes (nsexec + crun at create) are waited for through a
pidfd on the event loop (backends/container/spawn.py): no waiter thread per child, the exit
status, fds and umask as asyncio's spawn gave them, and no zombie when the waiter is cancelled."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from dsec.backends.container import driver
from dsec.backends.container.spawn import run_to_exit

PY = sys.executable


async def test_exit_status_fds_and_umask(tmp_path):
    assert await run_to_exit([PY, "-c", "raise SystemExit(3)"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) == 3
    r, w = os.pipe()
    out = tmp_path / "out"
    with open(out, "wb") as f:
        rc = await run_to_exit([PY, "-c", f"import os; os.write({w}, b'fd'); print(oct(os.umask(0)))"],
                               stdout=f.fileno(), stderr=f.fileno(), pass_fds=(w,), umask=0o022)
    os.close(w)
    assert rc == 0 and os.read(r, 2) == b"fd" and out.read_text().strip() == "0o22"
    os.close(r)


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
    task = asyncio.create_task(run_to_exit([PY, "-c", f"import os, time; os.write({w}, str(os.getpid()).encode()); "
                                                       "time.sleep(0.3)"],
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


def _ppid(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _exists(pid: int) -> bool:
    return _ppid(pid) != -1
