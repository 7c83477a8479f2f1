"""Choosing the accelerator: KVM when it actually boots a guest on this node, else TCG.

/dev/kvm existing is not enough: some hosts (these dev machines: a PVM hypervisor) expose a
KVM that cannot run ordinary guest kernels. So the probe boots the real guest kernel under
KVM without a root filesystem and waits for the kernel to reach the point where it looks for
init (it then panics, and `-no-reboot` makes QEMU exit). The answer is cached per host,
QEMU and kernel, so the probe runs once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Literal

from dsec.types import InvalidArgument

log = logging.getLogger("dsec.backends.vm")

PROBE_TIMEOUT_S = 20.0
BOOTED_MARKERS = (b"Kernel panic", b"VFS: Unable to mount root", b"No working init")


def _probe_kvm(qemu: str, kernel: Path) -> tuple[bool, str]:
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is missing or not accessible"
    argv = [qemu, "-machine", "microvm,accel=kvm", "-cpu", "host", "-m", "256M", "-nodefaults",
            "-no-user-config", "-display", "none", "-no-reboot", "-serial", "stdio",
            "-kernel", str(kernel), "-append", "console=ttyS0 panic=-1 root=/dev/dsec-none"]
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"a guest kernel did not boot under KVM within {PROBE_TIMEOUT_S:.0f}s"
    out = p.stdout + p.stderr
    if any(m in out for m in BOOTED_MARKERS):
        return True, "KVM boots a guest kernel"
    tail = out[-300:].decode(errors="replace").strip().replace("\n", " | ")
    return False, f"QEMU exited {p.returncode} before the guest kernel booted under KVM: {tail}"


class AccelChooser:
    def __init__(self, cache_file: Path, qemu: str, kernel: Path):
        self.cache_file = cache_file
        self.qemu = qemu
        self.kernel = kernel
        self._lock = asyncio.Lock()
        self._kvm: tuple[bool, str] | None = None

    def _key(self) -> str:
        st = Path(self.qemu).stat()
        return f"{os.uname().release}|{self.qemu}:{st.st_size}:{int(st.st_mtime)}|{self.kernel}"

    async def kvm_works(self) -> tuple[bool, str]:
        async with self._lock:
            if self._kvm is None:
                try:
                    cached = json.loads(self.cache_file.read_text())
                    if cached.get("key") == self._key():
                        self._kvm = (bool(cached["kvm"]), str(cached["reason"]))
                except (OSError, ValueError, KeyError):
                    pass
            if self._kvm is None:
                self._kvm = await asyncio.to_thread(_probe_kvm, self.qemu, self.kernel)
                self.cache_file.parent.mkdir(parents=True, exist_ok=True)
                self.cache_file.write_text(json.dumps({"key": self._key(), "kvm": self._kvm[0],
                                                       "reason": self._kvm[1]}))
                log.info("accelerator probe", extra={"kvm": self._kvm[0], "reason": self._kvm[1]})
            return self._kvm

    async def choose(self, wanted: str) -> Literal["kvm", "tcg"]:
        if wanted == "tcg":
            return "tcg"
        ok, reason = await self.kvm_works()
        if wanted == "kvm" and not ok:
            raise InvalidArgument(f"accel='kvm' is not usable on this node: {reason}", field="accel",
                                  fix="use accel='auto' (falls back to TCG) or 'tcg'")
        return "kvm" if ok else "tcg"
