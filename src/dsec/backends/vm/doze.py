"""Idle VMs off the CPU and out of RAM while nobody uses them (issue 31; D91 "dozing").

The edge's idle reclaim (edge/reclaim.py) asks a VM that nobody used for DSEC_RECLAIM_IDLE_S
to doze: if its QEMU used (almost) no CPU over a short look, its vCPUs are stopped (QMP `stop`,
what `pause` does: QEMU's main loop runs on, the guest's clock stands still) and its private
memory is pushed to the host's swap (zram: compressed in RAM) with process_madvise(MADV_PAGEOUT)
on QEMU's private mappings: the TCG code cache, QEMU's heap and TLBs, the guest pages it wrote.
Pages KSM merged or other processes map (the template's RAM) are skipped by the kernel. The next
request wakes it (QMP `cont`, then the guest clock is set again): what it touches comes back
from zram on first use.

This module is the mechanism; the driver keeps which VMs doze (so a wake is a set lookup when
they do not) and serialises doze/wake per VM.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from pathlib import Path

from dsec.procstat import cpu_ns

MADV_PAGEOUT = 21
_SYS_PROCESS_MADVISE = 440        # x86_64 and arm64 (generic syscall table) alike
_IOV_CHUNK = 512                  # below IOV_MAX (1024)
QUIET_LOOK_S = 0.2                # how long the CPU of a QEMU is watched before it dozes
QUIET_PCT = 5.0                   # more than this % of a core meanwhile: the guest works, no doze

_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def private_ranges(pid: int) -> list[tuple[int, int]]:
    """QEMU's private writable mappings (heap, code cache, stacks, guest RAM's copy-on-write
    pages, libraries' data): what pageout may push out. Shared mappings and the kernel's
    special ones ([vvar], [vdso]) are left."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            perms, name = parts[1], (parts[5].strip() if len(parts) > 5 else "")
            if perms[1] != "w" or perms[3] != "p" or name in ("[vvar]", "[vdso]", "[vsyscall]", "[vvar_vclock]"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi - lo))
    return out


def resident_private_bytes(pid: int) -> int:
    """RssAnon + RssShmem of a process: what pageout can move."""
    n = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssShmem:")):
            n += int(line.split()[1]) * 1024
    return n


def pageout(pid: int) -> int:
    """Push a (stopped) QEMU's private memory out of RAM. Returns the resident bytes that left.
    Root has the CAP_SYS_NICE and ptrace access process_madvise needs; a kernel without it
    (before 5.10) refuses with ENOSYS, raised as OSError."""
    before = resident_private_bytes(pid)
    pidfd = os.pidfd_open(pid)
    try:
        ranges = private_ranges(pid)
        for i in range(0, len(ranges), _IOV_CHUNK):
            chunk = ranges[i:i + _IOV_CHUNK]
            iov = (_Iovec * len(chunk))(*(_Iovec(lo, n) for lo, n in chunk))
            r = _libc.syscall(_SYS_PROCESS_MADVISE, pidfd, iov, len(chunk), MADV_PAGEOUT, 0)
            if r < 0:
                err = ctypes.get_errno()
                if err in (errno.ENOSYS, errno.EPERM):      # no such syscall / not permitted: say so
                    raise OSError(err, f"process_madvise(MADV_PAGEOUT): {os.strerror(err)}")
                # a mapping changed meanwhile (EINVAL/ENOMEM stop the batch): one range at a time
                for lo, n in chunk:
                    one = (_Iovec * 1)(_Iovec(lo, n))
                    _libc.syscall(_SYS_PROCESS_MADVISE, pidfd, one, 1, MADV_PAGEOUT, 0)
    finally:
        os.close(pidfd)
    return max(0, before - resident_private_bytes(pid))


def busy_pct(pid: int, look_s: float = QUIET_LOOK_S) -> float:
    """% of a core the process used over `look_s` (blocking: call in a thread)."""
    c0, t0 = cpu_ns(pid), time.monotonic()
    time.sleep(look_s)
    return 100.0 * (cpu_ns(pid) - c0) / max(1e-9, (time.monotonic() - t0) * 1e9)
