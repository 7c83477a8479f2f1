"""microVM and full-VM backends on QEMU: the same driver interface as containers.

Per sandbox, under <home>/vm/sb/<id>/: `upper.img` (raw ext4, cold boots) or `upper.qcow2`
(copy-on-write over a template's or snapshot's disk, whose bases are linked in beside it as
`chain-*`: chain.py), `agent.sock` (QEMU's end of the
virtio-serial agent port), `qmp.sock`, `console.in`/`console.out` (FIFOs of the serial console)
and `console.log` (what the edge read from it, size-capped: console.py), `qemu.pid`,
`spec.json` (what it was built from: snapshots and restarts need it).

Three ways to start a VM:
- cold boot: kernel + initramfs, root = overlay of the layers + the writable disk (guest.py);
- clone (default): a copy-on-write restore of the environment's template snapshot (guest RAM
  mapped privately from the template's RAM file, so untouched pages stay shared between all
  clones; device state from the migration stream; disk as a qcow2 overlay) — templates.py;
- restore-as-new of a snapshot taken with `snapshot()` (its RAM is in the stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

from dsec import procstat
from dsec.agent.client import AgentClient
from dsec.backends.base import (DOZE_BUSY, PARKED, RUNNING, Backend, Console, Doze, Egress, ImageStacks, LivenessWatched,
                                MemoryUsage, Parking, Prepared, RawUsage, Reclaim, Snapshots, UsageStats)
from dsec.backends.vm import balloon, chain, console as vmconsole, disks, doze, guest, ramshim, snapram, stubkernel
from dsec.backends.vm.accel import AccelChooser
from dsec.backends.vm.network import NET_FILE, VMNetwork, saved_allows
from dsec.backends.vm.pidwatch import PidWatch
from dsec.backends.vm.qemu import (Disk, Kind, Machine, Pmem, Qmp, kill, launch, pid_alive, pss_bytes, qemu_binary,
                                   qemu_log_tail)
from dsec.backends.vm.templates import Templates
from dsec.config import Paths
from dsec.images.store import Registry
from dsec.security.users import resolve_user
from dsec.settings import VMSettings
from dsec.types import (ImageInfo, InvalidArgument, MicroVMArgs, NetworkPolicy, NetworkRuleSet, NotFound, SandboxArgs,
                        SandboxFailed, Unavailable, VMArgs)

log = logging.getLogger("dsec.backends.vm")

CONSOLE_KEEP_BYTES = 256 << 10


@dataclass(frozen=True)
class LayerFile:
    digest: str
    path: Path


@dataclass(frozen=True)
class BootDisk:
    """A full VM that boots its image's own kernel and init from a disk (disks.py): the files
    of the disk build it was created from (paths, so a resume finds the same ones)."""

    name: str
    base: str                           # NAME.qcow2: backing file of the VM's own overlay
    kernel: str
    initrd: str | None
    append: str


@dataclass(frozen=True)
class VMSpec:
    """A VM sandbox as data (what the edge asks for)."""

    sandbox_id: str
    kind: Kind
    accel: Literal["kvm", "tcg"]
    layers: tuple[LayerFile, ...]       # bottom (base) first
    vcpus: int = 1
    memory_mb: int = 512
    disk_mb: int = 2048
    uid: int = 1000
    gid: int = 1000
    workdir: str = "/work"
    nofile: int = 4096
    pmem: bool = False
    clone: bool = True
    snapshot_dir: Path | None = None    # restore-as-new from this snapshot
    boot_disk: BootDisk | None = None   # q35 booting its own kernel/init from a disk (no layers)
    net: str | None = None              # a NIC (network.py); the guest's resolver address

    def boot_identity(self) -> dict:
        """What a template must share with a sandbox for the sandbox to be its clone."""
        out = {"kind": self.kind, "accel": self.accel, "layers": [lay.digest for lay in self.layers],
               "vcpus": self.vcpus, "memory_mb": self.memory_mb, "disk_mb": self.disk_mb,
               "uid": self.uid, "gid": self.gid, "workdir": self.workdir, "nofile": self.nofile,
               "pmem": self.pmem}
        if self.net is not None:   # the NIC is in the device state a clone restores
            out["net"] = self.net
        return out


HOLD_PREFIX = "vm:"      # layer holds (images/store.py) of VM sandboxes and snapshots


@dataclass(frozen=True)
class VMPlan:
    """What `prepare` resolved for `create`: the layers, or the snapshot or disk to start from."""

    layers: tuple[LayerFile, ...]
    snapshot_dir: Path | None = None
    boot_disk: BootDisk | None = None
    net: bool = False                   # a NIC: asked for, or the snapshot's VM had one


class VMDriver(Backend, Snapshots, Parking, Console, MemoryUsage, UsageStats, LivenessWatched, Reclaim, Doze, Egress):
    """Both QEMU backends ('microvm' and 'vm'); one instance serves both."""

    kinds = ("microvm", "vm")
    instead = {"pack_diff": "use snapshot() to save a VM"}

    def __init__(self, paths: Paths, settings: VMSettings | None = None, network: VMNetwork | None = None):
        self.paths = paths
        self.settings = settings or VMSettings()      # the composition root's (dsec.settings)
        self.ping_interval_s = self.settings.ping_s   # liveness check of idle VMs' guests
        # what a new VM holds resident once started (an awake clone: 37-50 MiB, D96): admission
        # near the memory floor counts it as taken until MemAvailable shows it (admit_wait.py)
        self.start_resident_mb = 48
        self.qemu = qemu_binary()               # Unavailable (names the fix) if QEMU is missing
        self.root = paths.vm_sandboxes
        self.snapshots = paths.vm_snapshots
        self.consoles = paths.vm / "consoles"     # console logs of ended VMs
        for p in (self.root, self.snapshots, paths.vm_templates):
            p.mkdir(parents=True, exist_ok=True)
        for p in self.snapshots.glob(".*"):      # a save or a deletion the last edge did not finish
            shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(paths.vm / "split", ignore_errors=True)    # ... and its RAM split (snapram.py)
        # VMs and snapshots attach layer files by path and must find them again on resume or
        # restore: they hold their layers against image GC while they exist
        self.holds = Registry(paths.images_db)
        alive = {p.name for p in self.root.iterdir()} | set(self.snapshot_ids())
        for holder in self.holds.holders(HOLD_PREFIX) - {HOLD_PREFIX + i for i in alive}:
            self.holds.release(holder)
        kernel = guest.installed_kernel(paths)   # never downloads here: that is install time
        if kernel is None:
            raise Unavailable("no guest kernel on this node", field="backend",
                              fix="run `dsec vm fetch-kernel` (scripts/install-extras.sh vm does), then restart dsec")
        self.kernel = kernel
        self.initrd = guest.build_initramfs(paths, kernel)
        self.ram_shim = ramshim.build(paths.bin)   # clones' QEMU: the template's RAM stays read-only
        self.accel = AccelChooser(paths.vm / "accel.json", self.qemu, self.kernel.vmlinuz)
        self.templates: Templates[VMSpec] = Templates(paths, self, self.settings.templates_max,
                                                               self.settings.template_ram)
        self.started: dict[str, str] = {}   # how each VM came up here: cold|clone|snapshot|resumed
        self._pidwatch = PidWatch()         # is_running without /proc reads per VM per tick
        self._stub_kernel: Path | bool | None = None   # restores' -kernel (stubkernel.py); False: none
        self._pmem_lock = asyncio.Lock()
        self.network = network        # the node's sandbox networks (None: VMs cannot have a NIC here)
        self._net_cgroups: dict[str, Path] = {}   # sandbox id -> the cgroup its next QEMU starts in
        self._dozing: set[str] = set()            # vCPUs stopped while idle (doze.py)
        self._unpaged: set[str] = set()           # ... of those, memory not paged out yet (D100)
        self._doze_locks: dict[str, asyncio.Lock] = {}
        if network is not None:       # their rows survive the container backend's recover()
            network.node.add_live_source(self._networked_live)

    # -- paths ---------------------------------------------------------------------------
    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def agent_socket(self, sandbox_id: str) -> Path:
        return self.sandbox_dir(sandbox_id) / "agent.sock"

    def _pid(self, sandbox_id: str) -> int | None:
        try:
            return int((self.sandbox_dir(sandbox_id) / "qemu.pid").read_text())
        except (OSError, ValueError):
            return None

    # -- the machine description -----------------------------------------------------------
    def append_line(self, spec: VMSpec) -> str:
        # microvm under TCG needs the TSC frequency or ~25% of boots hang (host-facts.md)
        tsc = guest.host_tsc_khz() if spec.kind == "microvm" and spec.accel == "tcg" else None
        # reboot=t: a reboot inside the guest triple-faults, which QEMU (-no-reboot) turns into
        # its exit; microvm has no keyboard controller, so the kernel's default methods spin
        net = (f"dsec.dns={spec.net}",) if spec.net is not None else ()
        return guest.kernel_cmdline(layers=len(spec.layers), pmem=spec.pmem, workdir=spec.workdir,
                                    uid=spec.uid, gid=spec.gid, nofile=spec.nofile, tsc_khz=tsc,
                                    extra=("reboot=t", *net))

    async def machine(self, spec: VMSpec, d: Path, upper: Disk, *, ram_file: Path | None = None,
                      ram_shared: bool = False, incoming: bool = False, name: str | None = None) -> Machine:
        if spec.boot_disk is not None:   # the image's kernel + init; the disk is /dev/vda (root=)
            b = spec.boot_disk
            return Machine(name=name or spec.sandbox_id, kind=spec.kind, accel=spec.accel, vcpus=spec.vcpus,
                           memory_mb=spec.memory_mb, kernel=Path(b.kernel),
                           initrd=Path(b.initrd) if b.initrd else None, append=b.append,
                           disks=(Disk(upper.path, "dsec-root", readonly=False, fmt=upper.fmt),),
                           ram_file=ram_file, ram_shared=ram_shared, agent_socket=d / "agent.sock",
                           qmp_socket=d / "qmp.sock", console_log=d / "console.log",
                           console_pipe=vmconsole.chardev_base(d), pidfile=d / "qemu.pid",
                           incoming=incoming, **self._memory_knobs(incoming))
        disks: list[Disk] = []
        pmems: list[Pmem] = []
        for i, lay in enumerate(spec.layers):
            if spec.pmem:
                pmems.append(await self._pmem_file(lay))
            else:
                disks.append(Disk(lay.path, f"dsec-l{i}"))
        disks.append(upper)
        kernel, initrd = self._kernel_files(spec, incoming)
        return Machine(name=name or spec.sandbox_id, kind=spec.kind, accel=spec.accel, vcpus=spec.vcpus,
                       memory_mb=spec.memory_mb, kernel=kernel, initrd=initrd,
                       append=self.append_line(spec), disks=tuple(disks), pmems=tuple(pmems),
                       ram_file=ram_file, ram_shared=ram_shared,
                       ram_shim=self.ram_shim if ram_file is not None and not ram_shared else None,
                       agent_socket=d / "agent.sock",
                       qmp_socket=d / "qmp.sock", console_log=d / "console.log",
                       console_pipe=vmconsole.chardev_base(d), pidfile=d / "qemu.pid",
                       incoming=incoming, net=spec.net is not None,
                       cgroup=self._net_cgroups.get(spec.sandbox_id) if spec.net is not None else None,
                       **self._memory_knobs(incoming))

    def _kernel_files(self, spec: VMSpec, incoming: bool) -> tuple[Path, Path | None]:
        """-kernel and -initrd: a microVM that restores saved state never reads them again, so it
        gets the kernel's setup header alone and no initramfs (stubkernel.py, D96)."""
        if incoming and spec.kind == "microvm" and self.settings.restore_stub_kernel:
            if self._stub_kernel is None:
                self._stub_kernel = stubkernel.restore_kernel(self.kernel.vmlinuz, self.paths.vm / "stub") or False
            if isinstance(self._stub_kernel, Path):
                return self._stub_kernel, None
        return self.kernel.vmlinuz, self.initrd

    def _memory_knobs(self, incoming: bool) -> dict:
        """Host-memory options of every VM's QEMU (D73: what an idle clone costs). The bounded
        TCG cache is for VMs started from saved state (clones, resumes, restores): a cold boot
        translates far more code than fits (a 256 MiB busybox boot took 10 s at 8 MiB vs 2.5 s unbounded)."""
        ksm = self.settings.ksm
        return {"tb_size_mb": self.settings.tcg_tb_size_mb if incoming else 0, "mem_merge": ksm != "0",
                "merge_all": ksm == "all", "shim": self.ram_shim,
                "thp_off": incoming and not self.settings.qemu_thp}

    async def _pmem_file(self, lay: LayerFile) -> Pmem:
        """virtio-pmem maps whole 2 MiB units: the layer padded to that (a copy made once per
        layer per node, shared by every VM)."""
        async with self._pmem_lock:
            path = await asyncio.to_thread(guest.pmem_image, lay.path, self.paths.vm / "pmem")
        return Pmem(path, path.stat().st_size)

    # -- lifecycle -----------------------------------------------------------------------
    async def prepare(self, args: SandboxArgs, images: ImageStacks) -> Prepared:
        """A clone of the environment's template by default; or a restore-as-new of a snapshot
        (which decides what the VM is); or a full VM booting a built disk."""
        assert isinstance(args, (MicroVMArgs, VMArgs))
        plan: VMPlan
        if (snapshot := args.snapshot) is not None:
            was, meta = self.snapshot_spec(snapshot)
            if was.kind != args.backend:
                raise InvalidArgument(f"snapshot {args.snapshot} is of a {was.kind!r} sandbox, not {args.backend!r}",
                                      field="backend", fix=f"create it with backend={was.kind!r}")
            args = args.model_copy(update={"vcpus": was.vcpus, "memory_mb": was.memory_mb, "disk_mb": was.disk_mb,
                                           "workdir": was.workdir, "accel": was.accel, "image": meta["image"]})
            if args.network is not None and was.net is None:
                raise InvalidArgument(f"network: snapshot {snapshot} is of a VM without a network device, and a "
                                      "restore has the devices of the VM it copies", field="network",
                                      fix="leave network unset, or snapshot a VM created with network")
            plan = VMPlan(was.layers, snapshot_dir=self.snapshot_dir(snapshot), boot_disk=was.boot_disk,
                          net=was.net is not None)
            uid, gid = was.uid, was.gid
            # the snapshot holds its layers: the image may have been rebuilt or removed since
            image_digest = meta.get("image_digest") or (await images.resolve(args.image)).digest
        elif isinstance(args, VMArgs) and args.disk:   # the image's own kernel + init from a built disk
            image = await images.resolve(args.image)
            plan = VMPlan((), boot_disk=self._boot_disk(args.disk, image))
            image_digest = image.digest
            uid, gid = resolve_user(args.user)
        else:
            stack = await images.stack(args)
            image_digest = stack[0].digest
            files = await asyncio.to_thread(images.layer_files, stack)
            plan = VMPlan(tuple(LayerFile(dg, p) for dg, p in files))
            uid, gid = resolve_user(args.user)
        allows = self._allows(args, plan)
        if args.network is not None and not plan.net:
            plan = VMPlan(plan.layers, plan.snapshot_dir, plan.boot_disk, net=True)
        args = args.model_copy(update={"accel": await self.accel.choose(args.accel)})
        return Prepared(args=args, image_digest=image_digest, uid=uid, gid=gid, plan=plan, allows=allows)

    def _allows(self, args: MicroVMArgs | VMArgs, plan: VMPlan) -> list:
        """The resolved egress policy of a VM with a NIC (422 naming the field before anything
        exists), refused by name where this node or this kind of VM cannot have one."""
        if args.network is None:
            return []
        if self.network is None:
            raise Unavailable("network: this node serves VMs without network devices (no sandbox network)",
                              field="network", fix="leave network unset, or use a container sandbox")
        if plan.boot_disk is not None:
            raise InvalidArgument("network: a VM booted from a disk (its own init) has no network device yet",
                                  field="network", fix="leave network unset, or use a VM without `disk` "
                                                       "(layers + dsec's init) or a container")
        return self.network.resolve(args.network)

    def _boot_disk(self, name: str, image: ImageInfo) -> BootDisk:
        """The files of VM disk `name` (disks.py), which must be of `image` as it is now."""
        info = disks.get(self.paths, name)         # NotFound names `disk` and the build command
        if info.image_digest != image.digest:
            raise InvalidArgument(f"VM disk {name!r} was built from {info.image} {info.image_digest[:19]}, "
                                  f"not from {image.name} {image.digest[:19]}", field="image",
                                  fix=f"pass image={info.image!r}, or rebuild the disk: "
                                      f"`dsec vm disk build {name} --image {image.name}`")
        f = info.files(self.paths)
        return BootDisk(name=name, base=str(f.qcow2), kernel=str(f.kernel),
                        initrd=str(f.initrd) if f.initrd else None, append=disks.kernel_append())

    async def create(self, sandbox_id: str, prepared: Prepared, images: ImageStacks) -> None:
        a, plan = prepared.args, prepared.plan
        assert isinstance(a, (MicroVMArgs, VMArgs)) and isinstance(plan, VMPlan) and a.accel != "auto"
        spec = VMSpec(sandbox_id=sandbox_id, kind=a.backend, accel=a.accel, layers=plan.layers,
                      vcpus=a.vcpus, memory_mb=a.memory_mb, disk_mb=a.disk_mb, uid=prepared.uid,
                      gid=prepared.gid, workdir=a.workdir, nofile=4096, pmem=bool(getattr(a, "pmem", False)),
                      clone=a.clone and plan.boot_disk is None, snapshot_dir=plan.snapshot_dir,
                      boot_disk=plan.boot_disk, net=self.network.resolver if plan.net and self.network else None)
        await self.start(sandbox_id, spec, list(prepared.allows))
        if spec.net is not None:
            await self._plug(sandbox_id, list(prepared.allows))

    async def _plug(self, sandbox_id: str, allows: list) -> None:
        """The running QEMU (started in its cgroup) under its policy (network.py): a veth when
        the policy allows anything. The VM is destroyed if that fails."""
        assert self.network is not None
        try:
            pid = self._pid(sandbox_id)
            if pid is None:
                raise SandboxFailed(f"VM {sandbox_id} has no QEMU process to plug in")
            await self.network.plug(sandbox_id, pid, allows)
        except BaseException:
            await asyncio.shield(self.destroy(sandbox_id))
            raise

    async def start(self, sandbox_id: str, spec: VMSpec, allows: list | None = None) -> None:
        """Boot, clone or restore the VM `spec` describes (with a NIC: in its cgroup, under
        `allows` once plugged in)."""
        d = self.sandbox_dir(sandbox_id)
        t0 = time.monotonic()
        phases: dict[str, float] = {}    # where a restore's time went (the log line below)
        try:
            await asyncio.to_thread(self.holds.hold, HOLD_PREFIX + sandbox_id, [lay.digest for lay in spec.layers])
            d.mkdir(mode=0o700)
            (d / "spec.json").write_text(json.dumps(_spec_json(spec)))
            if spec.net is not None and self.network is not None:
                self._net_cgroups[sandbox_id] = await self.network.prepare(sandbox_id, d, allows or [])
            if spec.snapshot_dir is not None:
                how = "snapshot"
                s = spec.snapshot_dir
                upper = s / _upper_name(s)
                ram = snapram.ram_of(s)      # split: mapped copy-on-write, shared with its other restores
                await self._restore(spec, d, s / "state", upper, f"{s.name}{upper.suffix}", chain.chain_files(s),
                                    ram_file=None if ram is None else snapram.link_into(ram, d),
                                    ignore_shared=ram is not None, phases=phases)
            elif spec.clone and spec.boot_disk is None:   # disk VMs always cold-boot (no templates)
                how = "clone"
                async with self.templates.use(spec) as tpl:
                    await self._restore(spec, d, tpl.state, tpl.upper, f"tpl-{tpl.key}.img", (),
                                        ram_file=tpl.ram, ignore_shared=True, phases=phases)
            else:
                how = "cold"
                await self.cold_boot(spec, d)
        except BaseException:
            await asyncio.shield(self.destroy(sandbox_id))
            raise
        self.started[sandbox_id] = how
        log.info("vm started", extra={"sandbox": sandbox_id, "how": how, "kind": spec.kind,
                                      "accel": spec.accel, "seconds": round(time.monotonic() - t0, 3),
                                      **{f"{k}_s": round(v, 4) for k, v in phases.items()}})

    def guest_identity(self) -> dict[str, str]:
        """The guest kernel and initramfs every layered VM boots: part of a template's key."""
        # the clock arguments a clone's guest booted with stay in its restored state
        return {"kernel": str(self.kernel.vmlinuz), "initrd": str(self.initrd),
                "clock": " ".join(guest.TCG_CLOCK_ARGS)}

    async def cold_boot(self, spec: VMSpec, d: Path, *, ram_file: Path | None = None,
                        ram_shared: bool = False, name: str | None = None) -> int:
        if spec.boot_disk is not None:   # a copy-on-write overlay: the built disk stays untouched
            upper_q = d / "upper.qcow2"
            base = chain.adopt(d, Path(spec.boot_disk.base), f"disk-{spec.boot_disk.name}.qcow2")
            await _run("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base, str(upper_q))
            m = await self.machine(spec, d, Disk(upper_q, "dsec-root", readonly=False, fmt="qcow2"), name=name)
            return await self._launch(m, d)
        upper = d / "upper.img"
        await asyncio.to_thread(guest.make_upper_disk, upper, spec.disk_mb)
        m = await self.machine(spec, d, Disk(upper, "dsec-upper", readonly=False), ram_file=ram_file,
                               ram_shared=ram_shared, name=name)
        return await self._launch(m, d)

    async def _launch(self, m: Machine, d: Path) -> int:
        """Start QEMU with its serial console read into console.log, size-capped (console.py):
        the reader opens the FIFO first, so not a byte of the boot is missed."""
        self._pidwatch.forget(d.name)       # a new QEMU for this dir: its pid is asked again
        vmconsole.make_fifos(d)
        vmconsole.attach(d, self.settings.console_max_bytes)
        return await launch(m, d)

    async def _restore(self, spec: VMSpec, d: Path, state: Path, base_disk: Path, base_name: str,
                       parents: Iterable[Path], *, ram_file: Path | None, ignore_shared: bool,
                       phases: dict[str, float] | None = None) -> None:
        """Start a VM from saved device state over a copy-on-write overlay of `base_disk`, whose
        chain (chain.py) is linked into `d` first, with the state: a deletion of the snapshot
        (or a template rebuild) from now on does not touch this VM."""
        upper = d / "upper.qcow2"
        fmt = "qcow2" if base_disk.suffix == ".qcow2" else "raw"
        incoming_state = d / "incoming.state"
        ph = phases if phases is not None else {}
        mark = time.monotonic()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            ph[name] = now - mark
            mark = now
        try:
            base = chain.adopt(d, base_disk, base_name, parents)
            os.link(state, incoming_state)
        except FileNotFoundError as e:
            raise NotFound(f"{state.parent.name} was removed while VM {spec.sandbox_id} was being created from it",
                           field="snapshot", fix="create it from another snapshot") from e
        if (state.parent / "console.log").is_file():   # the boot log of the guest it copies
            shutil.copyfile(state.parent / "console.log", d / "console.log")
        await _overlay(base, fmt, upper, proto=state.parent / f"overlay-{base}.qcow2" if ignore_shared else None)
        lap("disk")
        m = await self.machine(spec, d, Disk(upper, "dsec-upper", readonly=False, fmt="qcow2"),
                               ram_file=ram_file, ram_shared=False, incoming=True)
        await self._launch(m, d)
        lap("launch")
        try:
            async with Qmp(m.qmp_socket, spec.sandbox_id) as q:
                lap("qmp")
                if ignore_shared:   # RAM is not in the stream: it is the template's file, mapped privately
                    await q.run("migrate-set-capabilities",
                                capabilities=[{"capability": "x-ignore-shared", "state": True}])
                await q.incoming_file(incoming_state)
                # connect to the agent only once the devices are loaded: a host connection made
                # during the restore is overwritten by the saved port state (host disconnected)
                await q.wait_running()
                lap("restore")
            if ram_file is not None:     # a clone: its QEMU must not be able to write the template
                pid = self._pid(spec.sandbox_id)
                ramshim.check_readonly(pid if pid is not None else -1, ram_file, spec.sandbox_id)
            incoming_state.unlink()
        except SandboxFailed:
            raise
        except Exception as e:      # QMP lost: QEMU exited during the restore
            raise SandboxFailed(f"restoring VM {spec.sandbox_id} from {state.parent.name} failed "
                                f"({e.__class__.__name__}){console_tail(d)}",
                                fix="the snapshot may not match this node's QEMU or guest kernel; take a new one") from e

    async def wait_agent(self, name: str, d: Path | None = None,
                         timeout_s: float | None = None) -> AgentClient:
        """Connect to the guest agent of VM `name`, waiting for the guest to boot. One
        connection: its PING waits in QEMU until the agent runs (reconnecting could leave a
        stale PING behind). Fails early, with the console tail, if QEMU exits."""
        d = d or self.sandbox_dir(name)
        timeout_s = self.settings.boot_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s

        def qemu_gone() -> bool:
            try:
                return not pid_alive(int((d / "qemu.pid").read_text()), name)
            except (OSError, ValueError):
                return True

        while True:
            remaining = deadline - time.monotonic()
            attempt = asyncio.ensure_future(AgentClient.connect(d / "agent.sock", timeout=max(0.5, remaining)))
            while not attempt.done():
                await asyncio.wait([attempt], timeout=0.05)
                if not attempt.done() and (qemu_gone() or time.monotonic() > deadline):
                    attempt.cancel()
                    await asyncio.gather(attempt, return_exceptions=True)
                    break
            if attempt.done() and not attempt.cancelled() and attempt.exception() is None:
                return attempt.result()
            if qemu_gone():
                raise SandboxFailed(f"VM {name} exited while booting{console_tail(d)}",
                                    fix="see the console log; check the image has /bin/sh")
            if time.monotonic() > deadline:
                raise SandboxFailed(f"VM {name}: the guest agent did not answer within {timeout_s:.0f}s"
                                    f"{console_tail(d)}", fix="the guest hung while booting; retry or "
                                    "use clone=False / another accel")
            await asyncio.sleep(0.02)     # the socket is not there yet: QEMU is starting

    async def ready(self, sandbox_id: str, agent: AgentClient) -> None:
        """A clone or restored VM is a copy of another guest: give it its own entropy and the
        current time (its clock and RNG state are the template's)."""
        if self.started.get(sandbox_id, "cold") == "cold":
            return
        await agent.refresh(seed=secrets.token_bytes(64), time_ns=time.time_ns())

    async def destroy(self, sandbox_id: str) -> None:
        d = self.sandbox_dir(sandbox_id)
        pid = self._pid(sandbox_id)
        if pid is not None:
            await kill(pid, sandbox_id)
        self._pidwatch.forget(sandbox_id)
        vmconsole.detach(d)      # the last lines QEMU wrote, then stop reading
        self.started.pop(sandbox_id, None)
        self._undoze(sandbox_id)
        if self.network is not None:   # cheap when it had no NIC: no row, no cgroup
            self._net_cgroups.pop(sandbox_id, None)
            await self.network.detach(sandbox_id)
        if d.exists():
            self._keep_console(d)
            await asyncio.to_thread(shutil.rmtree, d, True)
        await asyncio.to_thread(self.holds.release, HOLD_PREFIX + sandbox_id)

    def _keep_console(self, d: Path) -> None:
        """The console log outlives the VM (for `console` on a failed sandbox), bounded in size
        and purged with the sandbox's record."""
        src = d / "console.log"
        if not src.is_file() or src.stat().st_size == 0:
            return
        self.consoles.mkdir(parents=True, exist_ok=True)
        with open(src, "rb") as f:
            f.seek(max(0, src.stat().st_size - CONSOLE_KEEP_BYTES))
            (self.consoles / f"{d.name}.log").write_bytes(f.read())

    def purge(self, older_than: float) -> None:
        for p in self.consoles.glob("*.log") if self.consoles.is_dir() else ():
            if p.stat().st_mtime < older_than:
                p.unlink(missing_ok=True)

    async def is_running(self, sandbox_id: str) -> bool:
        return self._pidwatch.alive(sandbox_id, lambda: self._pid(sandbox_id))

    async def list_ids(self) -> dict[str, str]:
        out = {}
        for d in self.root.iterdir() if self.root.exists() else ():
            out[d.name] = (RUNNING if await self.is_running(d.name)
                           else PARKED if self.is_saved(d.name) else "stopped")
        return out

    async def recover(self, live_ids: set[str]) -> None:
        """After an edge restart: read the consoles of the running VMs again (QEMU discarded
        what the guests wrote while no edge was connected)."""
        for sandbox_id in live_ids:
            d = self.sandbox_dir(sandbox_id)
            if vmconsole.tap_of(d) is None and await self.is_running(sandbox_id):
                vmconsole.attach(d, self.settings.console_max_bytes)
                # an edge that died during a reclaim left the balloon target low
                memory_mb = int(json.loads((d / "spec.json").read_text())["memory_mb"])
                await balloon.release(d, sandbox_id, memory_mb)
            if await self.is_running(sandbox_id) and await self._stopped(d, sandbox_id):
                self._dozing.add(sandbox_id)   # ... or dozing: its next request wakes it (and sets its clock)

    async def _stopped(self, d: Path, sandbox_id: str) -> bool:
        try:
            async with Qmp(d / "qmp.sock", sandbox_id) as q:
                return (await q.run("query-status")).get("status") == "paused"
        except Exception as e:    # the reaper fails a VM that is gone
            log.warning("could not ask a VM whether it runs", extra={"sandbox": sandbox_id, "error": repr(e)})
            return False

    async def reclaim(self, sandbox_id: str) -> int:
        """Idle reclaim, the VM way: a brief balloon squeeze (balloon.py), where it is cheap
        (`balloon.squeeze_enabled`: KVM by default; under TCG the guest's page zeroing makes
        it cost ~25 ms of a core per MiB, and what the guest frees is back already)."""
        d = self.sandbox_dir(sandbox_id)
        spec = json.loads((d / "spec.json").read_text())
        if not balloon.squeeze_enabled(spec["accel"], self.settings.reclaim):
            return 0
        return await balloon.squeeze(d, sandbox_id, int(spec["memory_mb"]), self._pid(sandbox_id),
                                     self.settings.reclaim_squeeze_s)

    async def pause(self, sandbox_id: str) -> None:
        self._undoze(sandbox_id)      # paused on purpose: a request must not run it again
        async with Qmp(self.sandbox_dir(sandbox_id) / "qmp.sock", sandbox_id) as q:
            await q.run("stop")

    async def resume(self, sandbox_id: str) -> None:
        self._undoze(sandbox_id)
        async with Qmp(self.sandbox_dir(sandbox_id) / "qmp.sock", sandbox_id) as q:
            await q.run("cont")

    # -- dozing (Doze: doze.py) ----------------------------------------------------------------
    def dozing(self, sandbox_id: str) -> bool:
        return sandbox_id in self._dozing

    def _undoze(self, sandbox_id: str) -> None:
        self._dozing.discard(sandbox_id)
        self._unpaged.discard(sandbox_id)
        self._doze_locks.pop(sandbox_id, None)

    async def doze(self, sandbox_id: str, pageout: bool = True) -> int:
        """Stop an idle VM's vCPUs and push its QEMU's private memory out (doze.py). Not VMs
        with a NIC (a server in the guest must answer its connections), nor a guest that used
        CPU over a short look (something of its own runs). Returns the bytes that left RAM, -1
        when it did not doze. `pageout=False` only stops it (the host is short of CPU, not of
        memory, D100); a later doze of it with pageout pushes its memory out."""
        d = self.sandbox_dir(sandbox_id)
        pid = self._pid(sandbox_id)
        if pageout and pid is not None and sandbox_id in self._dozing and sandbox_id in self._unpaged:
            self._unpaged.discard(sandbox_id)     # stopped already: its memory now (a wake meanwhile
            t0 = time.monotonic()                 # only faults back what it touches)
            out = await asyncio.to_thread(doze.pageout, pid) if self.settings.idle_pageout else 0
            log.info("vm dozing, paged out", extra={"sandbox": sandbox_id, "paged_out": out,
                                                    "pageout_ms": round((time.monotonic() - t0) * 1000, 1)})
            return out
        if not self.settings.idle_stop or pid is None or sandbox_id in self._dozing or _has_nic(d):
            return -1
        # dozing from here on (before any await): a request arriving now waits in wake() for
        # the lock and runs the VM again once it is stopped
        lock = self._doze_locks.setdefault(sandbox_id, asyncio.Lock())
        self._dozing.add(sandbox_id)
        async with lock:
            try:
                busy = await asyncio.to_thread(doze.busy_pct, pid)
                if busy > doze.QUIET_PCT or sandbox_id not in self._dozing:
                    self._dozing.discard(sandbox_id)
                    return DOZE_BUSY if busy > doze.QUIET_PCT else -1
                async with Qmp(d / "qmp.sock", sandbox_id) as q:
                    await q.run("stop")
            except BaseException:
                self._dozing.discard(sandbox_id)
                raise
        if not pageout:
            self._unpaged.add(sandbox_id)
            log.info("vm dozing", extra={"sandbox": sandbox_id, "busy_pct": round(busy, 2), "paged_out": 0})
            return 0
        t0 = time.monotonic()
        # outside the lock: a wake meanwhile only faults back what it touches
        out = await asyncio.to_thread(doze.pageout, pid) if self.settings.idle_pageout else 0
        log.info("vm dozing", extra={"sandbox": sandbox_id, "busy_pct": round(busy, 2), "paged_out": out,
                                     "pageout_ms": round((time.monotonic() - t0) * 1000, 1)})
        return out

    async def wake(self, sandbox_id: str) -> bool:
        if sandbox_id not in self._dozing:
            return False
        lock = self._doze_locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            if sandbox_id not in self._dozing:
                return False
            pid = self._pid(sandbox_id)
            if pid is None or not pid_alive(pid, sandbox_id):     # died dozing: the caller's use fails it
                self._dozing.discard(sandbox_id)
                self._unpaged.discard(sandbox_id)
                return False
            try:
                async with Qmp(self.sandbox_dir(sandbox_id) / "qmp.sock", sandbox_id) as q:
                    await q.run("cont")
            finally:
                self._dozing.discard(sandbox_id)   # QEMU gone: the caller's agent use fails it
                self._unpaged.discard(sandbox_id)
            return True

    # -- network (Egress) ------------------------------------------------------------------------
    async def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        """Replace a running VM's egress policy: new connections of its QEMU follow at once."""
        d = self.sandbox_dir(sandbox_id)
        if not (d / "spec.json").exists():
            raise FileNotFoundError(sandbox_id)
        if self.network is None or not _has_nic(d):
            raise InvalidArgument(f"network: VM {sandbox_id} was created without a network device",
                                  field="network", fix="create the VM with network={} (an empty policy: no egress "
                                                       "until set_network) to change its policy later")
        allows = self.network.resolve(policy, field="")
        pid = self._pid(sandbox_id)
        if pid is None or not pid_alive(pid, sandbox_id):
            raise FileNotFoundError(sandbox_id)
        await self.network.set_policy(sandbox_id, d, pid, allows)

    def set_rulesets(self, sets: dict[str, NetworkRuleSet]) -> None:
        if self.network is not None:
            self.network.rulesets.write(sets)

    def known_rulesets(self) -> set[str]:
        return set(self.network.rulesets.get()) if self.network is not None else set()

    def _networked_live(self) -> dict[str, int]:
        """Running VMs with a NIC: sandbox id -> QEMU pid (for the node network's recover)."""
        out = {}
        for d in self.root.iterdir() if self.root.exists() else ():
            pid = self._pid(d.name)
            if (d / NET_FILE).exists() and pid is not None and pid_alive(pid, d.name):
                out[d.name] = pid
        return out

    # -- snapshots -----------------------------------------------------------------------------
    async def snapshot(self, sandbox_id: str, snapshot_id: str, meta: dict) -> int:
        """Save a running VM (RAM and device state in the stream, a copy of its disk) so it can
        be restored as new sandboxes; the VM pauses for the save, then runs on. Returns bytes."""
        d = self.sandbox_dir(sandbox_id)
        out = self.snapshots / snapshot_id
        tmp = self.snapshots / f".{snapshot_id}.tmp"
        tmp.mkdir(parents=True)
        try:
            spec = json.loads((d / "spec.json").read_text())
            (tmp / "spec.json").write_text(json.dumps({**spec, **meta, "source": sandbox_id}))
            # no longer dozing: a request meanwhile must not run it during the save (it runs on after)
            self._undoze(sandbox_id)
            async with Qmp(d / "qmp.sock", sandbox_id) as q:
                await q.run("stop")
                paused = time.monotonic()
                try:
                    await q.save_state(tmp / "state")
                    upper = d / _upper_name(d)
                    # the disk as it was at the pause; a qcow2 keeps naming its (immutable)
                    # bases, linked in beside it
                    await _run("cp", "--sparse=always", str(upper), str(tmp / upper.name))
                    chain.carry(d, tmp)
                    vmconsole.drain(d)
                    if (d / "console.log").is_file():
                        shutil.copyfile(d / "console.log", tmp / "console.log")
                finally:
                    await q.run("cont")
                    log.info("vm snapshot pause", extra={"sandbox": sandbox_id,
                                                         "paused_s": round(time.monotonic() - paused, 3)})
            # its RAM as a file every restore maps copy-on-write (snapram.py); a failure
            # only costs the sharing: the whole stream stays and restores as before
            try:
                await snapram.split(self, _spec_from_json(spec), tmp, tmp / upper.name,
                                    self.paths.vm / "split" / secrets.token_hex(4), _run)
            except Exception as e:
                log.warning("vm snapshot ram not split: restores copy it", extra={
                    "snapshot": snapshot_id, "error": f"{e.__class__.__name__}: {e}"[:300]})
            for f in tmp.iterdir():
                f.chmod(0o400)            # restored VMs read these, nothing writes them again
            await asyncio.to_thread(self.holds.hold, HOLD_PREFIX + snapshot_id,
                                    [lay["digest"] for lay in spec["layers"]])
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            await asyncio.shield(asyncio.to_thread(self.holds.release, HOLD_PREFIX + snapshot_id))
            raise
        return chain.own_bytes(out)

    # -- stop-to-disk and resume -----------------------------------------------------------
    async def park(self, sandbox_id: str) -> int:
        """Park a VM: its RAM and device state go to `saved.state` in its dir, QEMU exits
        (the host memory is free), the writable disk stays where it is. Returns bytes saved."""
        d = self.sandbox_dir(sandbox_id)
        tmp, out = d / "saved.state.tmp", d / "saved.state"
        self._undoze(sandbox_id)      # stopped for the save; the resumed QEMU (or a failed save) runs
        async with Qmp(d / "qmp.sock", sandbox_id) as q:
            await q.run("stop")
            try:
                await q.save_state(tmp)
            except BaseException:
                await q.run("cont")       # could not save: the VM runs on as before
                tmp.unlink(missing_ok=True)
                raise
        os.replace(tmp, out)
        pid = self._pid(sandbox_id)
        if pid is not None:
            await kill(pid, sandbox_id)
        self._pidwatch.forget(sandbox_id)
        vmconsole.detach(d)
        if self.network is not None and (d / NET_FILE).exists():   # its netns went with QEMU
            self._net_cgroups.pop(sandbox_id, None)
            await self.network.detach(sandbox_id)
        for f in ("agent.sock", "qmp.sock", "qemu.pid"):
            (d / f).unlink(missing_ok=True)
        self.started.pop(sandbox_id, None)
        return out.stat().st_blocks * 512

    def is_saved(self, sandbox_id: str) -> bool:
        return (self.sandbox_dir(sandbox_id) / "saved.state").is_file()

    async def unpark(self, sandbox_id: str) -> None:
        """Resume a parked VM in place: same disk, RAM from `saved.state` (then deleted)."""
        d = self.sandbox_dir(sandbox_id)
        spec = _spec_from_json(json.loads((d / "spec.json").read_text()))
        upper = d / _upper_name(d)
        fmt = "qcow2" if upper.suffix == ".qcow2" else "raw"
        if spec.net is not None and self.network is not None:   # a new QEMU: born in its cgroup again
            self._net_cgroups[sandbox_id] = await self.network.prepare(sandbox_id, d, saved_allows(d))
        m = await self.machine(spec, d, Disk(upper, "dsec-upper", readonly=False, fmt=fmt), incoming=True)
        await self._launch(m, d)
        try:
            async with Qmp(m.qmp_socket, sandbox_id) as q:
                await q.incoming_file(d / "saved.state")
                await q.wait_running()
        except BaseException as e:
            pid = self._pid(sandbox_id)
            if pid is not None:
                await kill(pid, sandbox_id)
            if isinstance(e, SandboxFailed):
                raise
            raise SandboxFailed(f"resuming VM {sandbox_id} failed ({e.__class__.__name__}){console_tail(d)}") from e
        (d / "saved.state").unlink()
        self.started[sandbox_id] = "resumed"
        if spec.net is not None:   # a new QEMU, a new netns: plugged in again under the same policy
            await self._plug(sandbox_id, saved_allows(d))

    def snapshot_dir(self, snapshot_id: str) -> Path:
        d = self.snapshots / snapshot_id
        if not (d / "state").is_file():
            raise NotFound(f"no snapshot {snapshot_id!r} on this node", field="snapshot",
                           fix="use an id returned by Sandbox.snapshot(); list them with `dsec vm snapshot ls`")
        return d

    def snapshot_ids(self) -> list[str]:
        return sorted(p.name for p in self.snapshots.glob("snap-*") if (p / "state").is_file())

    def snapshot_record(self, snapshot_id: str) -> dict:
        """What `SnapshotInfo` is made of: the edge's meta (image, project, source, created_at),
        the VM kind and the bytes the snapshot holds of its own."""
        d = self.snapshot_dir(snapshot_id)
        j = json.loads((d / "spec.json").read_text())
        return {"id": snapshot_id, "backend": j["kind"], "image": j.get("image", ""),
                "project": j.get("project", ""), "sandbox_id": j.get("source", ""),
                "created_at": j.get("created_at") or (d / "state").stat().st_mtime, "size_bytes": chain.own_bytes(d),
                "name": j.get("name")}

    def snapshot_records(self) -> list[dict]:
        out = []
        for snapshot_id in self.snapshot_ids():
            try:
                out.append(self.snapshot_record(snapshot_id))
            except (NotFound, FileNotFoundError):     # deleted meanwhile
                continue
        return out

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Take a snapshot out of use at once (a rename before any await: a concurrent restore
        sees all of it or none), then free it. VMs restored from it hold links to its disk and
        are not affected (chain.py)."""
        d = self.snapshot_dir(snapshot_id)
        gone = self.snapshots / f".{snapshot_id}.deleting"
        os.rename(d, gone)
        await asyncio.to_thread(self.holds.release, HOLD_PREFIX + snapshot_id)
        await asyncio.to_thread(shutil.rmtree, gone, True)

    def snapshot_spec(self, snapshot_id: str) -> tuple[VMSpec, dict]:
        """The VM a snapshot was taken of, and what the edge stored beside it (image, project)."""
        j = json.loads((self.snapshot_dir(snapshot_id) / "spec.json").read_text())
        own = {f.name for f in fields(VMSpec)}
        return (_spec_from_json({k: v for k, v in j.items() if k in own}),
                {k: v for k, v in j.items() if k not in own})

    # -- what the edge asks of every backend, the VM way -------------------------------------
    disk_enforced = True     # the writable disk has a fixed size: the guest sees ENOSPC

    def console(self, sandbox_id: str, tail: int) -> bytes:
        """The end of the serial console log (kept after the VM ends, until its record goes)."""
        path = self.consoles / f"{sandbox_id}.log"
        if not path.exists():
            path = self.sandbox_dir(sandbox_id) / "console.log"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - tail))
                return f.read()
        except FileNotFoundError:
            return b""

    def end_reason(self, sandbox_id: str, cause: BaseException | None) -> str:
        """Why QEMU is gone, from the end of its console (QEMU runs with -no-reboot and the
        guest with panic=-1, so a panic, a reboot and a poweroff all end the process)."""
        console = self.log_tail(sandbox_id)
        if "Kernel panic" in console:
            return "the guest kernel panicked"
        if "reboot: Restarting system" in console or "reboot: Power down" in console:
            return "the guest shut itself down (reboot or poweroff inside the VM)"
        return "the VM's QEMU process exited (killed, or crashed)"

    def end_code(self, sandbox_id: str) -> str:
        """The guest powering off or rebooting itself is the sandbox's own doing (exited)."""
        console = self.log_tail(sandbox_id)
        if "Kernel panic" not in console and ("reboot: Restarting system" in console or "reboot: Power down" in console):
            return "exited"
        return "agent_died"

    async def release_node(self) -> None:
        await asyncio.to_thread(self.templates.remove_all)   # template RAM (tmpfs, or disk): give it back

    def disk_usage(self, sandbox_id: str) -> int:
        d = self.sandbox_dir(sandbox_id)
        return sum(p.stat().st_blocks * 512 for p in d.glob("upper.*"))

    def log_tail(self, sandbox_id: str, n: int = 800) -> str:
        return console_tail(self.sandbox_dir(sandbox_id), n)

    def usage(self, sandbox_id: str) -> RawUsage | None:
        """The host's view of the guest: its QEMU's CPU time (vCPU threads included) and
        resident memory (the guest's touched RAM; no page-cache split), its disk files."""
        pid = self._pid(sandbox_id)
        if pid is None or not pid_alive(pid, sandbox_id):
            return None
        try:
            raw = qemu_usage(pid)
            return RawUsage(cpu_ns=raw[0], mem_bytes=raw[1], mem_cache=0, disk_bytes=self.disk_usage(sandbox_id))
        except (OSError, ValueError, IndexError):
            return None

    def pss(self, sandbox_id: str) -> int | None:
        pid = self._pid(sandbox_id)
        return pss_bytes(pid) if pid is not None and pid_alive(pid, sandbox_id) else None


_TICK_NS = 10**9 // procstat.TCK
_PAGE = os.sysconf("SC_PAGE_SIZE")


def qemu_usage(pid: int) -> tuple[int, int]:
    """(CPU ns, resident bytes) of a process: /proc/PID/stat utime+stime, /proc/PID/statm."""
    ut, st, _, _ = procstat.cpu_ticks(pid)
    cpu = (ut + st) * _TICK_NS
    return cpu, int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE


def console_tail(d: Path, n: int = 800) -> str:
    """The end of the guest's serial console, and QEMU's own errors if it wrote any."""
    vmconsole.drain(d)     # QEMU may have written its last lines (a panic) and exited just now
    try:
        tail = (d / "console.log").read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        tail = ""
    out = f" (console: ...{tail})" if tail else ""
    qemu_err = qemu_log_tail(d, 400)
    return out + (f" (qemu: {qemu_err})" if qemu_err else "")


def _upper_name(d: Path) -> str:
    """The writable disk of a VM or snapshot dir: a qcow2 overlay, or a cold boot's raw disk."""
    return "upper.qcow2" if (d / "upper.qcow2").exists() else "upper.img"


def _has_nic(d: Path) -> bool:
    """Whether the VM in `d` was created with a network device (its spec.json says so)."""
    return json.loads((d / "spec.json").read_text()).get("net") is not None


def _spec_json(spec: VMSpec) -> dict:
    out = asdict(spec)
    out["layers"] = [{"digest": lay.digest, "path": str(lay.path)} for lay in spec.layers]
    out["snapshot_dir"] = str(spec.snapshot_dir) if spec.snapshot_dir else None
    out["boot_disk"] = asdict(spec.boot_disk) if spec.boot_disk else None
    return out


def _spec_from_json(j: dict) -> VMSpec:
    return VMSpec(**{**j, "layers": tuple(LayerFile(lay["digest"], Path(lay["path"])) for lay in j["layers"]),
                     "snapshot_dir": Path(j["snapshot_dir"]) if j.get("snapshot_dir") else None,
                     "boot_disk": BootDisk(**j["boot_disk"]) if j.get("boot_disk") else None})


async def _overlay(base: str, fmt: str, upper: Path, proto: Path | None) -> None:
    """A new empty qcow2 `upper` over `base` (a name relative to upper's dir). With `proto`
    (beside a template: every clone's overlay is the same bytes, the backing file being named
    relatively) the first one made is kept there and later ones are copies of it: a file copy
    instead of a qemu-img process per clone."""
    if proto is not None and proto.is_file():
        try:
            await asyncio.to_thread(shutil.copyfile, proto, upper)
            return
        except FileNotFoundError:     # the template was evicted meanwhile: make it afresh
            pass
    await _run("qemu-img", "create", "-q", "-f", "qcow2", "-F", fmt, "-b", base, str(upper))
    if proto is not None:
        tmp = proto.with_name(f".{proto.name}.{secrets.token_hex(4)}")
        try:
            shutil.copyfile(upper, tmp)
            os.replace(tmp, proto)
        except OSError:               # the template dir is gone: nothing to keep
            tmp.unlink(missing_ok=True)


async def _run(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxFailed(f"{argv[0]} failed: {(err or out).decode(errors='replace').strip()[-800:]}")
