"""Helpers of the containment suite: run attack code inside a sandbox, read host state.

Attack code runs *inside* sandboxes (shell, or python3 via ctypes in `debian-python`); every
check of the host runs here, in the test process, which is the host.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

from dsec import procstat
from dsec.backends.container import cgroups
from dsec.backends.container.spec import cgroup_path

# Prepended to every python attack: `sc(nr, *args)` makes a raw syscall and answers "ok" or
# the errno name; `attempt(fn, ...)` does the same for a Python call; OUT is printed as JSON.
PRELUDE = r'''
import ctypes, errno, json, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def _c(a):
    return ctypes.c_ulong(a & 0xFFFFFFFFFFFFFFFF) if isinstance(a, int) else a
def sc(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[_c(a) for a in args])
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def sc_ret(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[_c(a) for a in args])
    return r if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def attempt(fn, *a, **k):
    try:
        fn(*a, **k)
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
def read(path, n=1 << 20):
    try:
        with open(path, "rb") as f:
            return "ok:" + f.read(n).decode(errors="replace")
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
OUT = {}
'''
EPILOGUE = "\nprint(json.dumps(OUT))\n"

DENIED = ("EPERM", "EACCES")          # what a refused syscall answers (seccomp, caps, Landlock)


async def py(sb, code: str, *, user: str | None = "root", timeout_s: float = 60) -> dict:
    """Run PRELUDE + code with python3 inside the sandbox; return its OUT dict."""
    name = f"/tmp/attack-{os.urandom(4).hex()}.py"
    await sb.files.write(name, PRELUDE + code + EPILOGUE, mode=0o644)
    r = await sb.run(f"python3 {name}", user=user, timeout_s=timeout_s)
    assert r.exit_code == 0, f"attack script crashed: {r.stderr[-2000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


async def sh(sb, cmd: str, *, user: str | None = "root", timeout_s: float = 60):
    return await sb.run(cmd, user=user, timeout_s=timeout_s)


def sha256(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


SB_CGROUP_RE = re.compile(r"/dsec/(sb-[a-z0-9][a-z0-9-]{0,30}\.[0-9a-f]{12})\b")


def pids_by_sandbox() -> dict[str, set[int]]:
    """Live host pids grouped by the dsec sandbox cgroup they are in (any dsec instance).
    Zombies are left out: a killed sandbox's processes are reparented to the host's init,
    which may take a moment to reap them; they no longer run."""
    out: dict[str, set[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            text = (p / "cgroup").read_text()
            if procstat.fields(int(p.name))[0] in ("Z", "X"):
                continue
        except (OSError, IndexError):
            continue
        m = SB_CGROUP_RE.search(text)
        if m:
            out.setdefault(m.group(1), set()).add(int(p.name))
    return out


def host_mounts_of(home: Path) -> list[tuple[str, str]]:
    """(mount point, fs type) of every host mount that mentions this dsec home."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if str(home) not in line:
                continue
            left, _, right = line.partition(" - ")
            out.append((left.split()[4], right.split()[0]))
    return out


def host_ipv4_addresses() -> list[str]:
    """This host's own IPv4 addresses except loopback (what a sandbox might try to reach)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    addrs = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    return [a for a in addrs if not a.startswith("127.")]


def cgroup_file(sandbox_id: str, controller: str, name: str) -> Path:
    """A cgroup v1 controller file of a sandbox (these hosts are hybrid v1/v2)."""
    if cgroups.is_unified():
        return cgroups.CGROUP_ROOT / cgroup_path(sandbox_id).lstrip("/") / name
    return cgroups.CGROUP_ROOT / controller / cgroup_path(sandbox_id).lstrip("/") / name


def clock_offset() -> float:
    return time.time() - time.monotonic()


def mem_available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
