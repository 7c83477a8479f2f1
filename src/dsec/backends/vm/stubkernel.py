"""The kernel a VM started from saved state is given: the real bzImage's setup header only.

QEMU reads `-kernel` and `-initrd` whole into its own memory at start (x86_load_linux: the
fw_cfg blobs the boot ROM copies into the guest), restored VMs included, although the guest
they restore has booted long ago and never reads them again (a reboot ends the VM: reboot=t
and -no-reboot). For a layered microVM that is ~8 MiB of kernel and ~4 MiB of initramfs of
fresh anonymous pages per clone, zeroed and copied at every create and held until ksmd merges
them (issue 31: a burst with hundreds alive, D96). What the loader needs of the file is the
setup header (magic, protocol, setup size); the machine, its ROMs and RAM blocks are the
same, so the migration stream of a cold-booted template restores into it unchanged.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

HDRS_MAGIC = 0x53726448          # "HdrS" at 0x202: a bzImage with a boot protocol header
_PAYLOAD = 4096                  # a token payload after the setup sectors (QEMU reads it as the kernel)


def setup_size(header: bytes) -> int:
    """Bytes of the real-mode setup at the start of a bzImage (x86 boot protocol)."""
    sects = header[0x1F1] or 4
    return (sects + 1) * 512


def restore_kernel(vmlinuz: Path, cache_dir: Path) -> Path | None:
    """A stub of `vmlinuz` for VMs that restore saved state (made once per kernel file, beside
    the others in cache_dir); None when the file is not a bzImage (then the real one is used)."""
    st = vmlinuz.stat()
    key = hashlib.sha256(f"{vmlinuz.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir / f"restore-{key}.bzimage"
    if target.is_file():
        return target
    with open(vmlinuz, "rb") as f:
        head = f.read(64 << 10)
    if len(head) < 0x210 or int.from_bytes(head[0x202:0x206], "little") != HDRS_MAGIC:
        return None
    n = setup_size(head) + _PAYLOAD
    if n > len(head):
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".stub-", dir=cache_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(head[:n])
        os.chmod(tmp, 0o644)      # as readable as the kernel it stands for
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
