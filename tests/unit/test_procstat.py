"""dsec.procstat, the one reader of /proc/PID/stat (drivers, benches, benchmarks/procstat.py,
tests): a command name with spaces and parentheses does not shift the fields after it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from dsec import procstat


def test_fields_after_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    odd = tmp_path / "a) b (c"          # the kernel's comm is the executable's name (15 bytes max)
    odd.symlink_to("/bin/sleep")
    p = subprocess.Popen([str(odd), "30"])
    try:
        comm, f = procstat.split(Path(f"/proc/{p.pid}/stat").read_text())
        # state and CPU times move between two reads: the fields that cannot (ppid, pgrp, session)
        assert comm == "a) b (c" and f[1:4] == procstat.fields(p.pid)[1:4]
        assert f[0] in ("R", "S", "D") and int(f[1]) == os.getpid()
        assert (p.pid, "a) b (c", os.getpid()) in {(pid, c, pp) for pid, c, pp, _ in procstat.processes()}
        assert all(t >= 0 for t in procstat.cpu_ticks(p.pid))
    finally:
        p.kill()
        p.wait()


def test_cpu_of_this_process() -> None:
    while procstat.cpu_ticks(os.getpid())[0] + procstat.cpu_ticks(os.getpid())[1] < 2:
        pass                             # busy until it has used a tick or two
    ut, st, _, _ = procstat.cpu_ticks(os.getpid())
    assert procstat.cpu_s(os.getpid()) >= (ut + st) / procstat.TCK > 0
    assert procstat.cpu_ns(os.getpid()) > 0
