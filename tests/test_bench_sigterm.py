"""A benchmark stopped with SIGTERM (GNU `timeout`, a CI runner) leaves nothing behind: the VMs it
started are killed and its server home removed. QEMUs outlive a server's clean stop on purpose
(the edge adopts them again on restart), so a bench that died at once on SIGTERM left them
running, with its home (found on the 800-clone run that `timeout` ended)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsec.home_qemus import qemu_pids_of

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]

BENCH = textwrap.dedent("""
    import asyncio, time
    from dsec.bench.server import BenchServer
    s = BenchServer("dsec-bench-sigterm-")
    try:
        s.prepare(["busybox"])
        s.start()
        async def one():
            async with s.client() as c:
                sb = await c.create_microvm(image="busybox", memory_mb=128)
                assert (await sb.run("true")).exit_code == 0
        asyncio.run(one())
        print(s.home, flush=True)
        time.sleep(600)
    finally:
        s.close()
""")


def test_a_bench_ended_by_sigterm_kills_its_vms_and_removes_its_home():
    p = subprocess.Popen([sys.executable, "-c", BENCH], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    home = None
    try:
        line = p.stdout.readline().strip()
        assert line, f"the bench ended before its VM ran (exit {p.wait()})"
        home = Path(line)
        assert qemu_pids_of(home), "the bench's clone should be running"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) != 0
        assert qemu_pids_of(home) == [], "a QEMU of the bench outlived it"
        assert not home.exists(), f"the bench's home {home} was left behind"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if home is not None and home.exists():          # the old behaviour: clean up after it
            from dsec.testing.isolated import cleanup_home
            pid_file = home / "server.pid"                  # its server outlived it too
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            cleanup_home(home)
