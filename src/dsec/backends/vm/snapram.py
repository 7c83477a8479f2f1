"""A user snapshot's guest RAM as a file its restores map privately, as template clones do.

A snapshot is saved from a running VM whose RAM is anonymous memory (or a private mapping of
its template's file): QEMU's stream then holds the RAM, and each restore read it into RAM of
its own, so N forks cost N copies of the parent's memory (173 MiB host PSS per fork of a 256 MiB
busybox microvm). `split` turns the saved stream into the template layout (templates.py): a
helper QEMU, never run, loads the stream into a RAM file it maps shared (`share=on`: the file
then holds exactly the guest's memory; pages the stream says are zero stay holes), and saves
its device state again with `x-ignore-shared`, which leaves that RAM out. A restore maps `ram`
privately (copy-on-write: every page a fork writes is its own, every page none writes is one
page of the host's page cache for all of them), with the RAM shim preloaded (ramshim.py) so
neither its QEMU nor the balloon can change the file. The helper opens a throwaway overlay of
the snapshot's disk and is killed once the state is written; on any failure the snapshot keeps
the whole stream and restores as before.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from dsec.backends.vm.qemu import Disk, Machine, Qmp, kill, launch, shell_safe

log = logging.getLogger("dsec.backends.vm")

RAM = "ram"                 # in a snapshot dir: the guest RAM (sparse), when split
LINKED = "snap.ram"         # in a restored VM's dir: its link to the snapshot's RAM file


class Machines(Protocol):
    """What split needs of the driver (driver.VMDriver): taken, not imported (driver imports this)."""

    async def machine(self, spec: Any, d: Path, upper: Disk, *, ram_file: Path | None = None,
                      ram_shared: bool = False, incoming: bool = False, name: str | None = None) -> Machine: ...


async def split(driver: Machines, spec: Any, snap: Path, upper: Path, work: Path, run: Any) -> None:
    """Make `snap/state` (RAM + devices) into `snap/ram` + `snap/state` (devices only). `snap`
    is the snapshot's directory while it is being written; `upper` its disk copy; `work` a new
    directory on the same filesystem with a short path (QMP's unix socket lives there); `run`:
    the driver's subprocess runner (qemu-img)."""
    t0 = time.monotonic()
    work.mkdir(mode=0o700, parents=True)
    name = f"split-{work.name}"
    pid = -1
    try:
        overlay = work / "upper.qcow2"      # the helper never runs, but opens its disk read-write
        fmt = "qcow2" if upper.suffix == ".qcow2" else "raw"
        await run("qemu-img", "create", "-q", "-f", "qcow2", "-F", fmt, "-b", str(upper), str(overlay))
        m = await driver.machine(spec, work, Disk(overlay, "dsec-upper", readonly=False, fmt="qcow2"),
                                 ram_file=work / RAM, ram_shared=True, incoming=True, name=name)
        m = replace(m, console_pipe=None)   # its console is never read: a file nobody keeps
        pid = await launch(m, work)
        t_launch = time.monotonic()
        async with Qmp(m.qmp_socket, name) as q:
            await q.run("migrate-incoming", uri=f"exec:cat {shell_safe(snap / 'state')}")
            await q.wait_migration()
            t_load = time.monotonic()
            # loaded, and paused (the stream was saved paused): now the devices alone
            await q.run("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}])
            await q.run("migrate-set-parameters", **{"max-bandwidth": 64 << 30})
            await q.run("migrate", uri=f"exec:cat > {shell_safe(work / 'state')}")
            await q.wait_migration()
        await kill(pid, name)
        os.replace(work / RAM, snap / RAM)
        os.replace(work / "state", snap / "state")
        t_end = time.monotonic()      # the phases: where a loaded node spends the split (D83)
        log.info("vm snapshot ram split", extra={"snapshot": snap.name, "seconds": round(t_end - t0, 3),
                                                 "launch_s": round(t_launch - t0, 3), "load_s": round(t_load - t_launch, 3),
                                                 "save_s": round(t_end - t_load, 3),
                                                 "ram_bytes": (snap / RAM).stat().st_blocks * 512})
    finally:
        await kill(pid, name)
        shutil.rmtree(work, ignore_errors=True)


def ram_of(snap: Path) -> Path | None:
    """The snapshot's RAM file, if it was split (older snapshots hold RAM in their stream)."""
    p = snap / RAM
    return p if p.is_file() else None


def link_into(ram: Path, d: Path) -> Path:
    """The RAM file linked into a restored VM's dir (one inode: the page cache stays shared),
    so deleting the snapshot meanwhile changes nothing for the VM."""
    dst = d / LINKED
    try:
        os.link(ram, dst)
    except OSError:
        return ram             # another filesystem: map the snapshot's own (it is never written)
    return dst
