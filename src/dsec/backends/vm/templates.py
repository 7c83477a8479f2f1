"""Template snapshots: boot one VM per environment once, save it, clone it many times.

A template is a cold-booted VM whose guest RAM lives in a file (`share=on`, so the file holds
exactly the guest's memory), on the DSEC_HOME disk by default (DSEC_VM_TEMPLATE_RAM=disk, D95):
its pages are page cache, which the kernel drops and reads back under memory pressure, where
a tmpfs file's pages were swapped to zram (compressed, but still RAM) and every clone's restore
faulted them back in. Once its agent answers, the VM is paused, its device
state is saved with a migration that skips that RAM (`x-ignore-shared`), and it exits. A clone
maps the same RAM file *privately*: every page it never writes stays one shared page in the
host's page cache, whatever the number of clones. Its writable disk is a qcow2 overlay over
the template's disk. The clone's guest finds its agent port reconnected and carries on.

Templates are a cache keyed by everything that shapes the booted guest (layers, vCPUs, RAM,
disk size, user, workdir, kernel and initramfs); they are rebuilt when the RAM file is gone
(tmpfs does not survive a reboot). The cache is bounded: its RAM is tmpfs (unreclaimable
without swap) and every new image version or size makes a new template, so after a build the
least recently used beyond DSEC_VM_TEMPLATES_MAX (default 16) are removed. That never breaks a
VM: running clones keep their private mapping of the removed RAM file, parked clones hold
their RAM in their own saved state, and every clone links the template's disk (chain.py). A
template a creation is restoring from right now is never removed (`use`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from dsec.agent.client import AgentClient
from dsec.backends.vm import console as vmconsole
from dsec.backends.vm.qemu import Qmp, kill, shell_safe
from dsec.config import Paths

log = logging.getLogger("dsec.backends.vm")


class BootSpec(Protocol):
    """What Templates needs of a VM spec (driver.VMSpec, a dataclass with a sandbox_id)."""

    def boot_identity(self) -> dict[str, Any]: ...


Spec = TypeVar("Spec", bound=BootSpec)
SpecIn = TypeVar("SpecIn", bound=BootSpec, contravariant=True)


class Booter(Protocol[SpecIn]):
    """What Templates needs of the driver that owns it (driver.VMDriver). Taken, not imported:
    driver.py imports this module, and importing it back made the package's one import circle."""

    def guest_identity(self) -> dict[str, str]: ...

    async def cold_boot(self, spec: SpecIn, d: Path, *, ram_file: Path | None = None,
                        ram_shared: bool = False, name: str | None = None) -> int: ...

    async def wait_agent(self, name: str, d: Path | None = None) -> AgentClient: ...


@dataclass(frozen=True)
class Template:
    key: str
    dir: Path
    ram: Path

    @property
    def state(self) -> Path:
        return self.dir / "state"

    @property
    def upper(self) -> Path:
        return self.dir / "upper.img"


def ram_dir(paths: Paths, on: str = "disk") -> Path:
    """Where template RAM files live: `disk` under the home (page cache), `tmpfs` in /dev/shm
    (RAM speed, no writeback, but swapped under pressure), one dir per dsec home."""
    if on == "disk":
        return paths.vm / "template-ram"
    tag = hashlib.sha256(str(paths.home.resolve()).encode()).hexdigest()[:12]
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else paths.vm
    return base / f"dsec-vm-{tag}"


class Templates(Generic[Spec]):
    def __init__(self, paths: Paths, booter: Booter[Spec], max_templates: int = 16, ram_on: str = "disk"):
        self.paths = paths
        self.booter = booter
        self.root = paths.vm_templates
        self.rams = ram_dir(paths, ram_on)      # DSEC_VM_TEMPLATE_RAM
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}      # template key -> creations restoring from it now
        self.max_templates = max(1, max_templates)     # DSEC_VM_TEMPLATES_MAX

    def key(self, spec: Spec) -> str:
        ident = {**spec.boot_identity(), **self.booter.guest_identity()}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]

    def _template(self, key: str) -> Template:
        return Template(key, self.root / key, self.rams / f"{key}.ram")

    def _usable(self, t: Template) -> bool:
        return t.state.is_file() and t.upper.is_file() and t.ram.is_file()

    async def ensure(self, spec: Spec) -> Template:
        t = self._template(self.key(spec))
        if not self._usable(t):
            async with self._locks.setdefault(t.key, asyncio.Lock()):
                if not self._usable(t):
                    await self._build(spec, t)
                    self._evict()
        os.utime(t.dir)        # last use, for eviction
        return t

    @asynccontextmanager
    async def use(self, spec: Spec) -> AsyncIterator[Template]:
        """The template of `spec`, kept from eviction until the clone's QEMU has it mapped."""
        t = await self.ensure(spec)
        self._users[t.key] = self._users.get(t.key, 0) + 1    # no await since ensure: not evicted
        try:
            yield t
        finally:
            self._users[t.key] -= 1
            if not self._users[t.key]:
                del self._users[t.key]

    def _evict(self) -> None:
        """Remove the least recently used templates beyond max_templates (and RAM files left
        without their template), except those being built or restored from."""
        dirs = sorted((p for p in self.root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
        for d in dirs[self.max_templates:]:
            lock = self._locks.get(d.name)
            if d.name in self._users or (lock is not None and lock.locked()):
                continue
            shutil.rmtree(d, ignore_errors=True)
            (self.rams / f"{d.name}.ram").unlink(missing_ok=True)
            self._locks.pop(d.name, None)
            log.info("vm template evicted", extra={"template": d.name, "max": self.max_templates})
        kept = {p.name for p in self.root.iterdir()}
        for ram in self.rams.glob("*.ram"):
            if ram.stem not in kept:
                ram.unlink(missing_ok=True)

    async def _build(self, spec: Spec, t: Template) -> None:
        t0 = time.monotonic()
        shutil.rmtree(t.dir, ignore_errors=True)
        t.dir.mkdir(parents=True, mode=0o700)
        self.rams.mkdir(parents=True, exist_ok=True, mode=0o700)
        t.ram.unlink(missing_ok=True)
        name = f"tpl-{t.key[:12]}"
        boot = replace(spec, sandbox_id=name)   # type: ignore[type-var]  # a dataclass (VMSpec)
        pid = -1
        try:
            pid = await self.booter.cold_boot(boot, t.dir, ram_file=t.ram, ram_shared=True, name=name)
            agent = await self.booter.wait_agent(name, t.dir)
            # disconnect first: the saved guest then waits for a host, as every clone must
            await agent.close()
            async with Qmp(t.dir / "qmp.sock", name) as q:
                # saved while running (the migration stops it at the end, after the last device
                # state): the stream then says "running" and every clone starts by itself
                await q.run("migrate-set-capabilities",
                            capabilities=[{"capability": "x-ignore-shared", "state": True}])
                await q.run("migrate", uri=f"exec:cat > {shell_safe(t.dir / 'state.tmp')}")
                await q.wait_migration()
                try:
                    await q.run("quit")
                except Exception:   # QEMU may close the socket before it answers
                    pass
            await kill(pid, name)
            vmconsole.detach(t.dir)     # its boot log, which every clone starts with
            os.replace(t.dir / "state.tmp", t.state)
            os.chmod(t.upper, 0o400)      # the clones' qcow2 base: never written again
        except BaseException:
            await asyncio.shield(kill(pid, name))
            vmconsole.detach(t.dir)
            shutil.rmtree(t.dir, ignore_errors=True)
            t.ram.unlink(missing_ok=True)
            raise
        for f in ("agent.sock", "qmp.sock", "console.in", "console.out", "qemu.pid"):
            (t.dir / f).unlink(missing_ok=True)
        log.info("vm template built", extra={"template": t.key, "seconds": round(time.monotonic() - t0, 2),
                                             "ram_bytes": t.ram.stat().st_blocks * 512})

    def remove_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.rams, ignore_errors=True)
