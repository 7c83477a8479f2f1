"""The clone QEMU's RAM shim (backends/vm/ramshim.c) on the real kernel, without QEMU: a
process that preloads it and opens the template RAM file for writing gets a read-only fd (the
kernel then refuses writes and hole punches through it), a hole punch there is a no-op that
reports success (so QEMU goes on to madvise), and other files are untouched by the shim."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsec.backends.vm import ramshim
from dsec.types import SandboxFailed

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed (apt-get install gcc)")

PROBE = textwrap.dedent("""
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    ram, other = sys.argv[1], sys.argv[2]
    fd = os.open(ram, os.O_RDWR)
    print("ram-mode", os.O_ACCMODE & int(open(f"/proc/self/fdinfo/{fd}").read().split("flags:")[1].split()[0], 8))
    print("ram-write", end=" ")
    try:
        os.write(fd, b"x"); print("ok")
    except OSError as e:
        print(e.errno)
    # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    print("ram-punch", libc.fallocate64(fd, 3, ctypes.c_long(0), ctypes.c_long(4096)))
    fd2 = os.open(other, os.O_RDWR)
    print("other-punch", libc.fallocate64(fd2, 3, ctypes.c_long(0), ctypes.c_long(4096)))
""")


def test_shim_opens_the_ram_file_read_only_and_never_punches_it(tmp_path: Path) -> None:
    shim = ramshim.build(tmp_path / "bin")
    ram, other = tmp_path / "tpl.ram", tmp_path / "disk.img"
    ram.write_bytes(b"\x5a" * 8192)
    other.write_bytes(b"\x5a" * 8192)
    env = {**os.environ, **ramshim.env(shim, ram)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(ram), str(other)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["ram-mode"] == str(os.O_RDONLY)
    assert lines["ram-write"] == "9"                # EBADF: the kernel refuses writes through it
    assert lines["ram-punch"] == "0"                # reported done, so QEMU goes on to madvise
    assert ram.read_bytes() == b"\x5a" * 8192       # ... but the shared file is untouched
    assert lines["other-punch"] == "0"              # other files: the real fallocate
    assert other.read_bytes()[:4096] == bytes(4096)


def test_check_readonly_fails_closed_on_a_writable_fd(tmp_path: Path) -> None:
    ram = tmp_path / "tpl.ram"
    ram.write_bytes(bytes(4096))
    with open(ram, "r+b"):
        with pytest.raises(SandboxFailed, match="open for writing"):
            ramshim.check_readonly(os.getpid(), ram, "probe")
    with open(ram, "rb"):
        ramshim.check_readonly(os.getpid(), ram, "probe")
