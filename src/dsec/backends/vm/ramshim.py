"""Keep a clone's balloon from writing its template's RAM file (ramshim.c), and check it did.

A clone maps the template's RAM file privately. QEMU discards guest RAM (virtio-balloon free
page reporting and inflation) by punching a hole in the backing file before madvise: for a
private mapping of a shared file that zeroes the template under every other clone. The shim,
preloaded into the clone's QEMU, opens that file read-only (the kernel then refuses any write
or hole punch through it) and turns the hole punch into a no-op, so only the clone's private
copies are dropped. `check_readonly` reads the kernel's view of QEMU's open files after the
launch and fails the VM closed if the RAM file is open for writing (the shim did not load).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from dsec.types import SandboxFailed, Unavailable

log = logging.getLogger("dsec.backends.vm")

SOURCE = Path(__file__).with_name("ramshim.c")
ENV_PATH = "DSEC_RAM_READONLY"
KSM_ALL = "DSEC_KSM_ALL"        # "1": the shim makes all of QEMU's private memory mergeable
THP_OFF = "DSEC_THP_OFF"        # "1": the shim turns transparent huge pages off for QEMU


def build(bin_dir: Path) -> Path:
    """bin_dir/dsec-qemu-ramshim-<hash>.so, compiled once per source version (atomic rename:
    concurrent builders race harmlessly)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    out = bin_dir / f"dsec-qemu-ramshim-{digest}.so"
    if out.exists():
        return out
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise Unavailable("VM clones need a C compiler for their QEMU RAM shim", field="backend",
                          fix="apt-get install gcc libc6-dev (scripts/install.sh does)")
    bin_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=bin_dir, prefix=".dsec-qemu-ramshim-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", tmp, str(SOURCE), "-ldl"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise Unavailable(f"cannot compile {SOURCE.name}: {proc.stderr.strip()[-500:]}", field="backend",
                              fix="apt-get install gcc libc6-dev (scripts/install.sh does)")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("compiled native helper", extra={"helper": "qemu-ramshim", "path": str(out)})
    return out


def env(shim: Path, ram_file: Path) -> dict[str, str]:
    """What the clone's QEMU runs with."""
    return {"LD_PRELOAD": str(shim), ENV_PATH: str(ram_file)}


def open_modes(pid: int, path: Path) -> list[int]:
    """O_ACCMODE of every fd of process `pid` open on `path` (from /proc/<pid>/fdinfo)."""
    target = os.stat(path)
    modes = []
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            st = os.stat(fd_dir / fd)
            if (st.st_dev, st.st_ino) != (target.st_dev, target.st_ino):
                continue
            for line in (Path(f"/proc/{pid}/fdinfo") / fd).read_text().splitlines():
                if line.startswith("flags:"):
                    modes.append(int(line.split()[1], 8) & os.O_ACCMODE)
        except (OSError, ValueError):
            continue
    return modes


def check_readonly(pid: int, ram_file: Path, name: str) -> None:
    """Fail closed unless the clone's QEMU holds its template's RAM file read-only only."""
    try:
        modes = open_modes(pid, ram_file)
    except OSError as e:
        raise SandboxFailed(f"VM {name}: cannot inspect QEMU's open files ({e})") from e
    if not modes or any(m != os.O_RDONLY for m in modes):
        raise SandboxFailed(f"VM {name}: QEMU holds the template RAM file {ram_file} open for writing "
                            f"(modes {modes}); refusing to run a clone that could change the template",
                            fix="check that LD_PRELOAD works for qemu-system-x86_64 on this node")
