"""The edge: one per node. Admission, storage, runtime, agent channel, TTL reaping, recovery.

The apiserver talks to an edge only through the async methods of this class (in-process in
the embedded deployment; through a Ray actor or HTTP in a multi-node one), so those methods
take and return the shared wire models only.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.agent.client import AgentClient, AgentDisconnected, AgentError, DirEntry, Exit, Output
from dsec.backends.container.driver import ContainerDriver
from dsec.backends.container.idmap import host_to_sandbox
from dsec.backends.container.spec import ContainerSpec
from dsec.fncall.service import FnCallService
from dsec.config import Paths
from dsec.edge import output_budget
from dsec.edge.admission import Admission
from dsec.edge.records import EdgeRecords, SandboxRecord
from dsec.edge.users import resolve_user
from dsec.images.service import ImageService
from dsec.security.netpolicy import RULESETS_FILE, Rulesets, resolve
from dsec.types import FnCallRequest, FnCallResult, SnapshotInfo, Unavailable, VM_BACKENDS, make_snapshot_id
from dsec.types import DEFAULT_SCRUB, PackDiffRequest
from dsec.types import MicroVMArgs, SandboxArgs, VMArgs
from dsec.types import (CapacityExceeded, Conflict, DsecError, ExecEvent, ExecRequest, ExecResult,
                        FileEntry, ImageInfo, InvalidArgument, NetworkPolicy, NodeStatus, NotFound, SandboxFailed,
                        SandboxInfo, SandboxState, make_sandbox_id)

if TYPE_CHECKING:
    from dsec.backends.vm.driver import BootDisk, VMDriver

log = logging.getLogger("dsec.edge")

IMAGE_CACHE_S = 2.0
LIVE = (SandboxState.creating, SandboxState.running, SandboxState.suspended, SandboxState.stopping)
ERRNO_TO_ERROR = {2: NotFound, 13: InvalidArgument, 21: InvalidArgument, 20: InvalidArgument,
                  16: Conflict, 39: Conflict, 17: Conflict, 36: InvalidArgument, 27: InvalidArgument,
                  122: Conflict, 28: Conflict, 40: InvalidArgument, 11: CapacityExceeded,
                  7: InvalidArgument}
ERRNO_FIX = {2: "check the path (relative paths are relative to the sandbox workdir)",
             13: "the sandbox user may not access it; create the sandbox with user='root' if needed",
             21: "the path is a directory; use files.list", 20: "a parent of the path is not a directory",
             16: "wait for the running command in this session to finish, or use another session",
             39: "the directory is not empty", 17: "the path already exists",
             27: "the file is too large for one call",
             122: "the sandbox's writable layer is full (disk_mb): delete files, or create it with a larger disk_mb",
             28: "the sandbox's writable layer is full (disk_mb): delete files, or create it with a larger disk_mb",
             11: "the sandbox is out of processes (pids_limit) or memory: wait for background processes to "
                 "exit, kill them, or create the sandbox with a larger pids_limit/memory_mb",
             7: "the command is too long for one exec (128 KiB): write it to a file and run that",
             40: "paths through /proc magic links (e.g. /proc/PID/root, /proc/PID/fd) are refused; use the plain path"}
DISK_POLL_S = float(os.environ.get("DSEC_DISK_POLL_S", "10"))   # fallback quota check interval
VM_PING_S = float(os.environ.get("DSEC_VM_PING_S", "15"))         # liveness check of idle VMs' guests
VM_PING_TIMEOUT_S = 5.0
VM_PING_MISSES = 3                                                 # unanswered pings in a row = hung


@dataclass(frozen=True)
class EdgeSettings:
    node_id: str = "local"
    reap_interval_s: float = 2.0
    keep_ended_s: float = 24 * 3600      # stopped/failed records stay visible this long
    max_parallel_creates: int = 4
    fncall_project: str = "system"       # owner of the FnCall backend's warm pool containers


class Edge:
    def __init__(self, paths: Paths, images: ImageService, driver: ContainerDriver,
                 settings: EdgeSettings = EdgeSettings(), admission: Admission | None = None,
                 vm_driver: "VMDriver | None" = None, vm_problem: str | None = None):
        self.paths = paths
        self.images = images
        self.driver = driver            # containers (and the FnCall backend's pool containers)
        self.vm = vm_driver             # microvm + vm; None when this node cannot run QEMU guests
        self.vm_problem = vm_problem or (None if vm_driver else "the VM backends are not enabled on this node")
        self.drivers: dict[str, Any] = {"container": driver}
        if vm_driver is not None:
            self.drivers.update({b: vm_driver for b in VM_BACKENDS})
        self.settings = settings
        self.node_id = settings.node_id
        self.admission = admission or Admission.for_this_host()
        self.records = EdgeRecords(paths.edge_db)
        self._live: dict[str, SandboxRecord] = {}
        self._agents: dict[str, AgentClient] = {}
        self._agent_locks: dict[str, asyncio.Lock] = {}
        self._next_chan: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._budget_dirty: set[str] = set()   # sandboxes whose output_used_bytes changed
        self._create_slots = asyncio.Semaphore(settings.max_parallel_creates)
        self._reaper: asyncio.Task | None = None
        self._image_cache: dict[str, tuple[ImageInfo, float]] = {}
        self._lower_cache: dict[str, list[Path]] = {}
        self.fncall = FnCallService(self, settings.fncall_project)
        self.rulesets = Rulesets(paths.home / RULESETS_FILE)   # operator's named network rule sets
        self._net_locks: dict[str, asyncio.Lock] = {}
        self._park_locks: dict[str, asyncio.Lock] = {}
        self._vm_misses: dict[str, int] = {}
        self._vm_next_ping = 0.0

    # -- lifecycle of the edge itself ----------------------------------------------------
    async def start(self) -> None:
        await self._recover()
        await self.fncall.start()
        self._reaper = asyncio.create_task(self._reap_loop(), name="edge-reaper")
        log.info("edge started", extra={"node": self.node_id, "sandboxes": len(self._live)})

    async def close(self) -> None:
        """Stop serving. Sandboxes keep running; a restarted edge picks them up again (the
        FnCall backend's pool containers are stopped: they are a cache)."""
        await self.fncall.close()
        if self._reaper:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        self._flush_activity()
        for agent in list(self._agents.values()):
            await agent.close()
        self._agents.clear()
        self.records.close()
        if not self._live:
            # Nothing uses the node's layer mounts: leave no mount behind (`dsec down`). With
            # live sandboxes they stay, so a restarted edge shares their page cache again.
            await asyncio.to_thread(self.images.mounts.unmount_all)
            self._lower_cache.clear()
            if self.vm is not None:   # template RAM lives on tmpfs: give it back too
                await asyncio.to_thread(self.vm.templates.remove_all)

    @property
    def backends(self) -> list[str]:
        return ["container", "fncall"] + ([*VM_BACKENDS] if self.vm is not None else [])

    def _drv(self, rec_or_backend: "SandboxRecord | str") -> Any:
        backend = rec_or_backend if isinstance(rec_or_backend, str) else rec_or_backend.backend
        drv = self.drivers.get(backend)
        if drv is None:
            raise Unavailable(f"backend {backend!r} is not available on node {self.node_id}: {self.vm_problem}",
                              field="backend", fix="run `dsec vm fetch-kernel` and install qemu-system-x86 "
                                                   "(scripts/install.sh does both), then restart dsec")
        return drv

    async def _recover(self) -> None:
        runtime: dict[str, dict[str, str]] = {}
        for backend, drv in self.drivers.items():
            runtime[backend] = await drv.list_ids()
        for rec in self.records.load(LIVE):
            if rec.state == SandboxState.running and runtime.get(rec.backend, {}).get(rec.id) == "running":
                self._live[rec.id] = rec
                continue
            if rec.state == SandboxState.suspended and runtime.get(rec.backend, {}).get(rec.id) == "saved":
                self._live[rec.id] = rec     # parked on disk; resumed by its next request
                continue
            reason = {SandboxState.creating: "edge restarted while creating the sandbox",
                      SandboxState.running: "the sandbox died while the edge was down",
                      SandboxState.suspended: "the parked VM's saved state was lost"}.get(rec.state)
            if rec.backend in self.drivers:
                await self._drv(rec).destroy(rec.id)
            final = SandboxState.stopped if rec.state == SandboxState.stopping else SandboxState.failed
            self.records.set_state(rec.id, final, reason)
            log.warning("recovered sandbox", extra={"sandbox": rec.id, "was": rec.state.value, "now": final.value})
        # Anything the runtime or the disk holds that no live record owns is an orphan.
        on_disk = {p.name for p in self.paths.sandboxes.iterdir()} if self.paths.sandboxes.exists() else set()
        for orphan in (set(runtime["container"]) | on_disk) - set(self._live):
            log.warning("removing orphan sandbox", extra={"sandbox": orphan})
            await self.driver.destroy(orphan)
        if self.vm is not None:
            for orphan in set(runtime[VM_BACKENDS[0]]) - set(self._live):
                log.warning("removing orphan VM", extra={"sandbox": orphan})
                await self.vm.destroy(orphan)
        # IPs, veths, BPF of the dead; re-attach the live
        await self.driver.recover_network({i for i, r in self._live.items() if r.backend == "container"})

    # -- status for the watcher ----------------------------------------------------------
    async def status(self) -> NodeStatus:
        # parked VMs hold no CPU or memory: they do not count against admission
        live = [r for r in self._live.values() if r.state not in (SandboxState.stopping, SandboxState.suspended)]
        problem = self.admission.host_problem()
        return NodeStatus(node_id=self.node_id, healthy=problem is None, reason=problem,
                          backends=list(self.backends), capacity=self.admission.capacity,
                          committed_cpu_cores=sum(r.cpu_cores for r in live),
                          committed_memory_mb=sum(r.memory_mb for r in live), sandboxes=len(live))

    # -- create / get / list / stop ------------------------------------------------------
    async def create(self, project: str, args: SandboxArgs) -> SandboxInfo:
        if args.backend in VM_BACKENDS:
            return await self._create_vm(project, args)   # type: ignore[arg-type]
        image = await self._resolve_image(args.image)   # NotFound names the field
        # composition, bottom to top: base, workspace, toolkits in the order given (last topmost)
        stack = [image]
        if args.workspace is not None:
            stack.append(await self._resolve_image(args.workspace, "workspace"))
        for i, name in enumerate(args.toolkits):
            stack.append(await self._resolve_image(name, f"toolkits[{i}]"))
        uid, gid = resolve_user(args.user)
        allows = resolve(args.network, self.rulesets)   # 422 for unknown rule sets, before anything exists
        self.admission.admit(await self.status(), args.cpu_cores, args.memory_mb)
        now = time.time()
        rec = SandboxRecord(id=make_sandbox_id(self.node_id), project=project, backend="container",
                            state=SandboxState.creating, args=args.model_dump(mode="json"),
                            image=args.image, image_digest=image.digest, uid=uid, gid=gid,
                            created_at=now, last_active_at=now)
        self._live[rec.id] = rec
        self.records.insert(rec)   # durable before anything exists on the host
        try:
            async with self._create_slots:
                lower = await self._compose(stack)
                spec = ContainerSpec(sandbox_id=rec.id, lower_dirs=lower, cpu_cores=args.cpu_cores,
                                     memory_mb=args.memory_mb, pids_limit=args.pids_limit,
                                     uid=uid, gid=gid, workdir=args.workdir, network=tuple(allows),
                                     disk_mb=args.disk_mb, nofile=args.nofile, max_file_mb=args.max_file_mb)
                await self.driver.create(rec.id, spec)
            await self._agent(rec)   # ready means the agent answers
        except BaseException as e:
            await asyncio.shield(self._abort_create(rec, self.driver, e))
            if isinstance(e, DsecError):
                raise
            raise SandboxFailed(f"sandbox creation failed: {e!r}") from e
        rec.state = SandboxState.running
        self.records.set_state(rec.id, SandboxState.running)
        log.info("sandbox created", extra={"sandbox": rec.id, "image": args.image, "project": project})
        return rec.info(self.node_id)

    async def _create_vm(self, project: str, args: "MicroVMArgs | VMArgs") -> SandboxInfo:
        """A QEMU guest booting the same layers (clone of the environment's template by default)."""
        from dsec.backends.vm.driver import BootDisk, LayerFile, VMSpec
        vm = self._drv(args.backend)
        snapshot_dir = None
        boot_disk: BootDisk | None = None
        if args.snapshot is not None:     # restore-as-new: the snapshot decides what the VM is
            was, meta = vm.snapshot_spec(args.snapshot)
            if was.kind != args.backend:
                raise InvalidArgument(f"snapshot {args.snapshot} is of a {was.kind!r} sandbox, not {args.backend!r}",
                                      field="backend", fix=f"create it with backend={was.kind!r}")
            snapshot_dir = vm.snapshot_dir(args.snapshot)
            args = args.model_copy(update={"vcpus": was.vcpus, "memory_mb": was.memory_mb, "disk_mb": was.disk_mb,
                                           "workdir": was.workdir, "accel": was.accel, "image": meta["image"]})
            layers, uid, gid, boot_disk = was.layers, was.uid, was.gid, was.boot_disk
            # the snapshot holds its layers: the image may have been rebuilt or removed since
            image_digest = meta.get("image_digest") or (await self._resolve_image(args.image)).digest
        elif getattr(args, "disk", None):   # full VM: the image's own kernel + init from a built disk
            image = await self._resolve_image(args.image)
            boot_disk = self._boot_disk(args.disk, image)
            image_digest = image.digest
            layers = ()
            uid, gid = resolve_user(args.user)
        else:
            image = await self._resolve_image(args.image)
            image_digest = image.digest
            stack = [image]
            if args.workspace is not None:
                stack.append(await self._resolve_image(args.workspace, "workspace"))
            for i, name in enumerate(args.toolkits):
                stack.append(await self._resolve_image(name, f"toolkits[{i}]"))
            layers = tuple(LayerFile(d, p) for d, p in await asyncio.to_thread(self._layer_files, stack))
            uid, gid = resolve_user(args.user)
        accel = await vm.accel.choose(args.accel)
        args = args.model_copy(update={"accel": accel})
        self.admission.admit(await self.status(), args.cpu_cores, args.memory_mb)
        now = time.time()
        rec = SandboxRecord(id=make_sandbox_id(self.node_id), project=project, backend=args.backend,
                            state=SandboxState.creating, args=args.model_dump(mode="json"),
                            image=args.image, image_digest=image_digest, uid=uid, gid=gid,
                            created_at=now, last_active_at=now)
        self._live[rec.id] = rec
        self.records.insert(rec)
        try:
            spec = VMSpec(sandbox_id=rec.id, kind=args.backend, accel=accel, layers=layers,
                          vcpus=args.vcpus, memory_mb=args.memory_mb, disk_mb=args.disk_mb, uid=uid, gid=gid,
                          workdir=args.workdir, nofile=4096, pmem=bool(getattr(args, "pmem", False)),
                          clone=args.clone and boot_disk is None, snapshot_dir=snapshot_dir, boot_disk=boot_disk)
            async with self._create_slots:   # a burst of VMs starts a few QEMUs at a time
                await vm.create(rec.id, spec)
            await self._adopt_vm_agent(rec, await vm.wait_agent(rec.id))
        except BaseException as e:
            await asyncio.shield(self._abort_create(rec, vm, e))
            if isinstance(e, DsecError):
                raise
            raise SandboxFailed(f"sandbox creation failed: {e!r}") from e
        rec.state = SandboxState.running
        self.records.set_state(rec.id, SandboxState.running)
        log.info("sandbox created", extra={"sandbox": rec.id, "backend": args.backend, "accel": accel,
                                           "image": args.image, "project": project})
        return await self.get(rec.id)

    def _boot_disk(self, name: str, image: ImageInfo) -> "BootDisk":
        """The files of VM disk `name` (dsec.backends.vm.disks), which must be of `image` as it is now."""
        from dsec.backends.vm import disks
        from dsec.backends.vm.driver import BootDisk
        info = disks.get(self.paths, name)         # NotFound names `disk` and the build command
        if info.image_digest != image.digest:
            raise InvalidArgument(f"VM disk {name!r} was built from {info.image} {info.image_digest[:19]}, "
                                  f"not from {image.name} {image.digest[:19]}", field="image",
                                  fix=f"pass image={info.image!r}, or rebuild the disk: "
                                      f"`dsec vm disk build {name} --image {image.name}`")
        f = info.files(self.paths)
        return BootDisk(name=name, base=str(f.qcow2), kernel=str(f.kernel),
                        initrd=str(f.initrd) if f.initrd else None, append=disks.kernel_append())

    async def _abort_create(self, rec: SandboxRecord, driver: Any, error: BaseException) -> None:
        """A creation that failed leaves nothing: no agent channel, no runtime, a failed record."""
        self._live.pop(rec.id, None)
        await self._forget_agent(rec.id)
        await driver.destroy(rec.id)
        self.records.set_state(rec.id, SandboxState.failed, f"creation failed: {error!s}")
        log.error("create failed", extra={"sandbox": rec.id, "error": str(error) or repr(error)})

    async def _adopt_vm_agent(self, rec: SandboxRecord, agent: AgentClient) -> None:
        """Use the connection wait_agent made, then let the driver refresh a restored guest
        (clock, entropy: it copies another guest, or stood still while parked)."""
        self._agents[rec.id] = agent
        await self._continue_chans(rec.id, agent)
        await self._drv(rec).ready(rec.id, agent)

    def _layer_files(self, stack: list[ImageInfo]) -> list[tuple[str, Path]]:
        """EROFS layer files of base + workspace + toolkits, bottom first, each once (topmost)."""
        out: list[tuple[str, Path]] = []
        for part in stack:
            for lay in part.layers:
                out = [x for x in out if x[0] != lay.digest] + [(lay.digest, self.images.layer_source(lay.digest))]
        return out

    async def snapshot(self, sandbox_id: str) -> SnapshotInfo:
        """Save a running VM so it can be restored as new sandboxes (`snapshot=` in its args)."""
        rec = self._running(sandbox_id)
        if rec.backend not in VM_BACKENDS:
            raise InvalidArgument(f"sandbox {rec.id} is a {rec.backend}; snapshots are of VM sandboxes",
                                  field="sandbox_id", fix="use pack_diff to save a container's changes as a layer")
        self._touch(rec)
        snap_id = make_snapshot_id(self.node_id)
        rec.in_flight += 1
        try:
            size = await self._drv(rec).snapshot(rec.id, snap_id, {"image": rec.image, "image_digest": rec.image_digest,
                                                                  "project": rec.project, "created_at": time.time()})
        finally:
            rec.in_flight -= 1
        log.info("vm snapshot", extra={"sandbox": rec.id, "snapshot": snap_id, "bytes": size})
        return await self.get_snapshot(snap_id)

    def _vm_driver(self) -> Any:
        return self._drv(VM_BACKENDS[0])      # one driver serves every VM backend

    def _snapshot_info(self, r: dict) -> SnapshotInfo:
        return SnapshotInfo(node=self.node_id, **{**r, "created_at": datetime.fromtimestamp(r["created_at"], timezone.utc)})

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return self._snapshot_info(await asyncio.to_thread(self._vm_driver().snapshot_record, snapshot_id))

    async def list_snapshots(self, project: str | None = None) -> list[SnapshotInfo]:
        if self.vm is None:
            return []
        return [self._snapshot_info(r) for r in await asyncio.to_thread(self.vm.snapshot_records)
                if project is None or r["project"] == project]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot. Sandboxes restored from it and snapshots of those keep running and
        restoring: they hold their own links to its disk (backends/vm/chain.py)."""
        await self._vm_driver().delete_snapshot(snapshot_id)
        log.info("vm snapshot deleted", extra={"snapshot": snapshot_id})

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        """Park a VM on disk: memory and device state saved, QEMU gone, host memory free.
        Its next request (or resume()) brings it back where it was, running commands included."""
        rec = self._running(sandbox_id)
        if rec.backend not in VM_BACKENDS:
            raise InvalidArgument(f"sandbox {rec.id} is a {rec.backend}; only VM sandboxes can be parked on disk",
                                  field="sandbox_id", fix="stop the container, or use a microvm/vm sandbox")
        async with self._lock_for(rec.id):
            if rec.state != SandboxState.running:
                return rec.info(self.node_id)
            await self._forget_agent(rec.id)
            size = await self._drv(rec).save_to_disk(rec.id)
            rec.state = SandboxState.suspended
            self.records.set_state(rec.id, SandboxState.suspended)
        log.info("vm suspended", extra={"sandbox": rec.id, "bytes": size})
        return rec.info(self.node_id)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Bring a parked VM back (no-op for a running sandbox)."""
        rec = self._record(sandbox_id)
        async with self._lock_for(rec.id):
            if rec.state == SandboxState.suspended:
                self.admission.admit(await self.status(), rec.cpu_cores, rec.memory_mb)
                t0 = time.monotonic()
                vm = self._drv(rec)
                try:
                    await vm.restore_from_disk(rec.id)
                    await self._adopt_vm_agent(rec, await vm.wait_agent(rec.id))
                except DsecError as e:
                    await self._fail(rec, f"could not resume the parked VM: {e.message}")
                    raise
                rec.state = SandboxState.running
                self.records.set_state(rec.id, SandboxState.running)
                log.info("vm resumed", extra={"sandbox": rec.id, "seconds": round(time.monotonic() - t0, 3)})
        self._touch(rec)
        return rec.info(self.node_id)

    async def console(self, sandbox_id: str, tail: int = 65536) -> bytes:
        """The end of a VM's serial console log (kept while the record is, failed VMs included)."""
        rec = self._record(sandbox_id)
        if rec.backend not in VM_BACKENDS:
            raise InvalidArgument(f"sandbox {rec.id} is a {rec.backend}: only VMs have a console",
                                  field="sandbox_id", fix="read a container's output from its commands")
        path = self.paths.vm / "consoles" / f"{rec.id}.log"
        if not path.exists():
            path = self._drv(rec).sandbox_dir(rec.id) / "console.log"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - tail))
                return f.read()
        except FileNotFoundError:
            return b""

    def _lock_for(self, sandbox_id: str) -> asyncio.Lock:
        """Serialises parking and resuming one VM."""
        return self._park_locks.setdefault(sandbox_id, asyncio.Lock())

    async def _resolve_image(self, name: str, field: str = "image") -> ImageInfo:
        """Name -> image, cached briefly: a burst of 1,000 creations needs one registry read."""
        hit = self._image_cache.get(name)
        if hit and hit[1] > time.monotonic():
            return hit[0]
        image = await asyncio.to_thread(self.images.get, name, field)
        self._image_cache[name] = (image, time.monotonic() + IMAGE_CACHE_S)
        return image

    async def _compose(self, stack: list[ImageInfo]) -> list[Path]:
        """Mounted layers of base + workspace + toolkits, bottom first. A layer listed twice
        is kept only at its topmost position (overlayfs refuses a lowerdir used twice)."""
        lower: list[Path] = []
        for part in stack:
            lower += await self._lower_dirs(part.digest)
        seen: set[Path] = set()
        out: list[Path] = []
        for p in reversed(lower):
            if p not in seen:
                seen.add(p)
                out.append(p)
        return out[::-1]

    async def pack_diff(self, sandbox_id: str, req: PackDiffRequest) -> ImageInfo:
        """The sandbox's writable changes (upper dir: additions, modifications, whiteouts,
        opaque dirs), minus the scrub list, as a new workspace layer stacked on the
        workspace the sandbox started from."""
        rec = self._running(sandbox_id)
        if rec.backend != "container":
            raise InvalidArgument(f"sandbox {rec.id} is a {rec.backend}: pack_diff reads a container's writable layer",
                                  field="sandbox_id", fix="use snapshot() to save a VM")
        self._touch(rec)
        parents = []
        if rec.args.get("workspace"):
            parents.append(await self._resolve_image(rec.args["workspace"], "workspace"))
        scrub = list(DEFAULT_SCRUB if req.scrub is None else req.scrub)
        upper = self.driver.sandbox_dir(rec.id) / "upper"
        # a user-namespaced sandbox's upper holds host ids of its range: the layer gets the
        # ids as seen inside (root = 0), so it works in any other sandbox
        base = self.driver.id_base(rec.id)
        map_id = functools.partial(host_to_sandbox, base=base) if base is not None else None
        rec.in_flight += 1      # not reaped while packing
        # Frozen while its upper dir is read on the host: otherwise the sandbox could swap a
        # directory for a symlink mid-walk and have host files copied into the layer.
        await self.driver.pause(rec.id)
        try:
            info = await asyncio.to_thread(
                self.images.pack_upper, req.name, upper, parents=parents, scrub=scrub,
                source=f"pack_diff:{rec.id}:base={rec.image_digest}", replace=req.replace, map_id=map_id)
        finally:
            await self.driver.resume(rec.id)
            rec.in_flight -= 1
            self._touch(rec)
        self._image_cache.pop(req.name, None)
        log.info("pack_diff", extra={"sandbox": rec.id, "layer": req.name, "digest": info.digest})
        return info

    async def _lower_dirs(self, digest: str) -> list[Path]:
        """Mounted layers of an image; mounts are per node and digests immutable, so cache them."""
        lower = self._lower_cache.get(digest)
        if lower is None or not all(os.path.ismount(p) for p in lower):
            lower = await asyncio.to_thread(self.images.mount_image, digest)
            self._lower_cache[digest] = lower
        return lower

    def _record(self, sandbox_id: str) -> SandboxRecord:
        rec = self._live.get(sandbox_id) or self.records.get(sandbox_id)
        if rec is None:
            raise NotFound(f"no sandbox {sandbox_id!r} on node {self.node_id}", field="sandbox_id",
                           fix="list sandboxes with `dsec sandbox ls`; stopped ones are forgotten after a day")
        return rec

    async def get(self, sandbox_id: str, usage: bool = False) -> SandboxInfo:
        """The sandbox's record; with `usage`, also what it costs the host now (VMs: PSS, a
        /proc read: not for the ownership check every request makes)."""
        rec = self._record(sandbox_id)
        info = rec.info(self.node_id)
        if usage and rec.backend in VM_BACKENDS and rec.state == SandboxState.running and self.vm is not None:
            pss = await asyncio.to_thread(self.vm.pss, rec.id)   # what this VM costs the host now
            info.host_pss_mb = round(pss / (1 << 20), 1) if pss is not None else None
        return info

    async def list(self, project: str | None = None, include_ended: bool = False) -> list[SandboxInfo]:
        recs = self.records.load() if include_ended else list(self._live.values())
        # live records carry fresher state/activity than the database
        recs = [self._live.get(r.id, r) for r in recs]
        return [r.info(self.node_id) for r in recs if project is None or r.project == project]

    async def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        """Replace a running sandbox's egress policy; new connections see it immediately."""
        rec = self._running(sandbox_id)
        allows = resolve(policy, self.rulesets, field="")
        async with self._net_locks.setdefault(rec.id, asyncio.Lock()):
            try:
                await self._drv(rec).set_network(rec.id, allows)
            except FileNotFoundError as e:   # stopped (or died) under us
                raise Conflict(f"sandbox {rec.id} is {rec.state.value}", field="sandbox_id",
                               fix="create a new sandbox") from e
            rec.args = {**rec.args, "network": policy.model_dump(mode="json")}
            self.records.set_args(rec.id, rec.args)
        self._touch(rec)
        log.info("network policy replaced", extra={"sandbox": rec.id, "rules": len(allows)})
        return rec.info(self.node_id)

    async def stop(self, sandbox_id: str, reason: str | None = None) -> SandboxInfo:
        rec = self._record(sandbox_id)
        if rec.state in (SandboxState.stopped, SandboxState.failed):
            return rec.info(self.node_id)
        rec.state = SandboxState.stopping
        self.records.set_state(rec.id, SandboxState.stopping)
        await self._forget_agent(rec.id)
        await self._drv(rec).destroy(rec.id)
        rec.state, rec.error = SandboxState.stopped, reason or rec.error
        rec.ended_at = time.time()
        self.records.set_state(rec.id, SandboxState.stopped, reason)
        self._live.pop(rec.id, None)
        self._park_locks.pop(rec.id, None)
        log.info("sandbox stopped", extra={"sandbox": rec.id, "reason": reason or "requested"})
        return rec.info(self.node_id)

    async def _fail(self, rec: SandboxRecord, reason: str) -> None:
        if rec.state == SandboxState.failed:
            return                                  # already failed by another path
        # state first: requests woken by the teardown below must already see why
        rec.state, rec.error, rec.ended_at = SandboxState.failed, reason + self._init_log_tail(rec), time.time()
        self.records.set_state(rec.id, SandboxState.failed, rec.error)
        await self._forget_agent(rec.id)
        await self._drv(rec).destroy(rec.id)
        self._live.pop(rec.id, None)
        self._park_locks.pop(rec.id, None)
        log.error("sandbox failed", extra={"sandbox": rec.id, "reason": rec.error})

    def _init_log_tail(self, rec: SandboxRecord) -> str:
        if rec.backend in VM_BACKENDS:
            return self._drv(rec).log_tail(rec.id)   # the guest's serial console
        p = self.driver.sandbox_dir(rec.id) / "run" / "init.log"
        try:
            tail = p.read_bytes()[-500:].decode(errors="replace").strip()
        except OSError:
            return ""
        return f" (init log: {tail})" if tail else ""

    # -- agent channel -------------------------------------------------------------------
    def _running(self, sandbox_id: str) -> SandboxRecord:
        rec = self._record(sandbox_id)
        if rec.state != SandboxState.running:
            raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}" + (f": {rec.error}" if rec.error else ""),
                           field="sandbox_id", fix="create a new sandbox")
        return rec

    async def _agent(self, rec: SandboxRecord) -> AgentClient:
        agent = self._agents.get(rec.id)
        if agent is not None and not agent.closed:
            return agent
        lock = self._agent_locks.setdefault(rec.id, asyncio.Lock())
        async with lock:
            agent = self._agents.get(rec.id)
            if agent is None or agent.closed:
                agent = await AgentClient.connect(self._drv(rec).agent_socket(rec.id))
                await self._continue_chans(rec.id, agent)
                self._agents[rec.id] = agent
            return agent

    async def _continue_chans(self, sandbox_id: str, agent: AgentClient) -> None:
        """Chans the agent still retains (from before an edge restart, or in a restored guest)
        are not reused."""
        execs = await agent.list_execs()
        self._next_chan[sandbox_id] = max([c for c, _ in execs] + [self._next_chan.get(sandbox_id, 0)]) + 1

    async def _forget_agent(self, sandbox_id: str) -> None:
        agent = self._agents.pop(sandbox_id, None)
        self._agent_locks.pop(sandbox_id, None)
        self._net_locks.pop(sandbox_id, None)
        if agent is not None:
            await agent.close()

    @asynccontextmanager
    async def _use(self, sandbox_id: str):
        """An agent for a running sandbox; marks activity; turns a dead channel into a failure.
        A parked VM is resumed first: callers never see `suspended`."""
        rec = self._record(sandbox_id)
        if rec.state == SandboxState.suspended:
            await self.resume(sandbox_id)
        rec = self._running(sandbox_id)
        rec.in_flight += 1
        self._touch(rec)
        try:
            try:
                agent = await self._agent(rec)
            except (OSError, AgentDisconnected, asyncio.TimeoutError) as e:
                await self._check_alive(rec, e)
                raise
            yield rec, agent
        except AgentDisconnected as e:
            await self._check_alive(rec, e)
            raise SandboxFailed(f"lost the channel to sandbox {sandbox_id}'s agent; retry the request",
                                fix="retry; if it persists the sandbox is marked failed") from e
        finally:
            rec.in_flight -= 1
            self._touch(rec)

    async def _check_alive(self, rec: SandboxRecord, cause: BaseException) -> None:
        if rec.state == SandboxState.failed:       # failed meanwhile (e.g. a hung VM)
            raise SandboxFailed(f"sandbox {rec.id} failed: {rec.error}", field="sandbox_id",
                                fix="create a new sandbox") from cause
        if not await self._drv(rec).is_running(rec.id):
            if rec.backend in VM_BACKENDS:
                await self._fail(rec, _vm_end_reason(self._init_log_tail(rec)))
            else:
                await self._fail(rec, f"sandbox process exited ({cause.__class__.__name__})")
            raise SandboxFailed(f"sandbox {rec.id} failed: {rec.error}", field="sandbox_id",
                                fix="create a new sandbox") from cause

    def _touch(self, rec: SandboxRecord) -> None:
        rec.last_active_at = time.time()
        self._dirty.add(rec.id)

    def _flush_activity(self) -> None:
        for sid in self._budget_dirty & set(self._live):   # output_used_bytes survives a restart
            self.records.set_args(sid, self._live[sid].args)
        self._budget_dirty.clear()
        items = [(self._live[i].last_active_at, i) for i in self._dirty if i in self._live]
        self._dirty.clear()
        if items:
            self.records.touch_many(items)

    # -- exec ------------------------------------------------------------------------------
    def _exec_user(self, rec: SandboxRecord, user: str | None) -> tuple[int, int]:
        return resolve_user(user) if user else (rec.uid, rec.gid)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """start, stdout/stderr chunks as they arrive, then exit with the full ExecResult."""
        async with self._use(sandbox_id) as (rec, agent):
            chan = self._next_chan[rec.id]
            self._next_chan[rec.id] = chan + 1
            uid, gid = self._exec_user(rec, req.user)
            cap = req.output_cap_bytes or int(rec.args.get("output_cap_bytes", 1 << 20))
            # the sandbox's lifetime output budget (output_budget.py) may shrink this cap
            grant = output_budget.reserve(rec, cap)
            delivered = grant.reserved   # unless the exit result says less (abandoned: all)
            self._budget_dirty.add(rec.id)
            env = {**rec.args.get("env", {}), **req.env}
            try:
                try:   # sent before "start" is announced: a restarted edge can then attach to it
                    events = await agent.start_exec(
                        chan, cmd=req.cmd, uid=uid, gid=gid, cwd=req.cwd, env=env,
                        timeout_ms=int(req.timeout_s * 1000), cap=grant.per_stream, session=req.session,
                        stdin=req.stdin.encode() if req.stdin is not None else None)
                except AgentError as e:
                    delivered = 0
                    raise _map_agent_error(e, "cmd") from e
                yield ExecEvent(type="start", exec_id=str(chan))
                try:
                    async for ev in _events(str(chan), events, time.monotonic()):
                        if ev.type == "exit" and ev.result is not None:
                            r = ev.result
                            delivered = min(r.stdout_bytes, grant.per_stream) + min(r.stderr_bytes, grant.per_stream)
                            r.output_budget_exhausted = grant.exhausted and (r.truncated or grant.per_stream == 0)
                        yield ev
                except AgentError as e:   # could not start (EAGAIN at pids_limit, EBUSY session ...)
                    delivered = 0
                    raise _map_agent_error(e, "session" if e.errno == 16 else "cmd") from e
                await agent.release(chan)
            finally:
                output_budget.settle(rec, grant, delivered)

    async def run(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        async for ev in self.exec_stream(sandbox_id, req):
            if ev.type == "exit":
                assert ev.result is not None
                return ev.result
        raise SandboxFailed("exec ended without an exit status")

    async def attach(self, sandbox_id: str, exec_id: str) -> ExecResult:
        """Result of an earlier exec (e.g. after the client or the edge restarted)."""
        try:
            chan = int(exec_id)
        except ValueError:
            raise InvalidArgument(f"bad exec id {exec_id!r}", field="exec_id", fix="use the exec_id from run/stream") from None
        async with self._use(sandbox_id) as (rec, agent):
            try:
                async for ev in _events(exec_id, agent.attach(chan), time.monotonic()):
                    if ev.type == "exit":
                        await agent.release(chan)
                        assert ev.result is not None
                        return ev.result
            except AgentError as e:
                raise _map_agent_error(e, "exec_id") from e
        raise SandboxFailed("attach ended without an exit status")

    async def close_session(self, sandbox_id: str, name: str) -> None:
        async with self._use(sandbox_id) as (_, agent):
            await agent.close_session(name)

    # -- files -------------------------------------------------------------------------------
    async def read_file(self, sandbox_id: str, path: str, maxlen: int = 64 << 20) -> bytes:
        _check_path(path)
        async with self._use(sandbox_id) as (rec, agent):
            try:
                return await agent.read_file(path, uid=rec.uid, gid=rec.gid, maxlen=maxlen)
            except AgentError as e:
                raise _map_agent_error(e, "path") from e

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644,
                         mkdirs: bool = True) -> None:
        _check_path(path)
        async with self._use(sandbox_id) as (rec, agent):
            try:
                await agent.write_file(path, data, uid=rec.uid, gid=rec.gid, mode=mode, mkdirs=mkdirs)
            except AgentError as e:
                raise _map_agent_error(e, "path") from e

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        _check_path(path)
        async with self._use(sandbox_id) as (rec, agent):
            try:
                entries: list[DirEntry] = await agent.list_dir(path, uid=rec.uid, gid=rec.gid)
            except AgentError as e:
                raise _map_agent_error(e, "path") from e
        return [FileEntry(name=e.name, type=e.kind, size=e.size, mode=e.mode, mtime=e.mtime) for e in entries]

    async def remove_file(self, sandbox_id: str, path: str) -> None:
        _check_path(path)
        async with self._use(sandbox_id) as (rec, agent):
            try:
                await agent.remove(path, uid=rec.uid, gid=rec.gid)
            except AgentError as e:
                raise _map_agent_error(e, "path") from e

    # -- FnCall backend: calls run in warm pool containers (dsec.fncall) ------------
    async def fncall_run(self, req: FnCallRequest) -> FnCallResult:
        return await self.fncall.run(req)

    async def fncall_pools(self) -> list[dict]:
        return self.fncall.stats()

    @asynccontextmanager
    async def agent_channel(self, sandbox_id: str):
        """(agent, exec chan) of a running sandbox, for a backend that drives the agent itself
        (FnCall's long-lived zygote exec). The sandbox counts as busy while this is held."""
        async with self._use(sandbox_id) as (rec, agent):
            chan = self._next_chan[rec.id]
            self._next_chan[rec.id] = chan + 1
            yield agent, chan

    # -- reaping -----------------------------------------------------------------------------
    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            try:
                await self.reap_once()
                await self._poll_disk()
                await self._check_vms()
            except Exception:  # the reaper must outlive any single bad sandbox
                log.exception("reaper iteration failed")

    async def _poll_disk(self) -> None:
        """Fallback disk quota (no kernel quota on this node, see backends/container/disk.py):
        every DISK_POLL_S, measure each running sandbox's writable layer and fail the ones
        beyond disk_mb, saying so in their error."""
        if getattr(self.driver, "disk_enforced", True) or time.monotonic() < getattr(self, "_disk_next", 0.0):
            return
        self._disk_next = time.monotonic() + DISK_POLL_S
        for rec in [r for r in self._live.values() if r.state == SandboxState.running and r.backend == "container"]:
            limit = int(rec.args.get("disk_mb", 10240)) << 20
            used = await asyncio.to_thread(self.driver.disk_usage, rec.id)
            if used > limit and rec.state == SandboxState.running:
                await self._fail(rec, f"disk quota exceeded: the writable layer holds {used >> 20} MiB, "
                                      f"more than disk_mb={limit >> 20}")

    async def _check_vms(self) -> None:
        """A VM whose QEMU has exited (guest kernel panic with panic=-1 and -no-reboot, QEMU
        killed or crashed) is marked failed at once, with the console tail as the reason."""
        vms = [r for r in self._live.values() if r.state == SandboxState.running and r.backend in VM_BACKENDS]
        for rec in vms:
            if not await self._drv(rec).is_running(rec.id) and rec.state == SandboxState.running:
                await self._fail(rec, _vm_end_reason(self._init_log_tail(rec)))
        if time.monotonic() >= self._vm_next_ping:
            # A guest that stopped scheduling (hung kernel, stuck vCPU, a reboot that spins)
            # keeps QEMU alive: only its agent's silence tells. Busy VMs too: a request in
            # flight to a dead guest would otherwise wait forever; failing the VM ends it.
            self._vm_next_ping = time.monotonic() + VM_PING_S
            live = [r for r in vms if r.state == SandboxState.running]
            await asyncio.gather(*(self._ping_vm(r) for r in live))

    async def _ping_vm(self, rec: SandboxRecord) -> None:
        try:
            agent = await asyncio.wait_for(self._agent(rec), VM_PING_TIMEOUT_S)
            await asyncio.wait_for(agent.ping(), VM_PING_TIMEOUT_S)
            self._vm_misses.pop(rec.id, None)
        except (OSError, ConnectionError, asyncio.TimeoutError, AgentError):
            # the connection stays: requests in flight keep it, and a late PONG goes to its own
            # (abandoned) chan and is dropped; a dead connection is replaced by the next _agent()
            misses = self._vm_misses[rec.id] = self._vm_misses.get(rec.id, 0) + 1
            if misses >= VM_PING_MISSES and rec.state == SandboxState.running:
                self._vm_misses.pop(rec.id, None)
                await self._fail(rec, f"the guest stopped answering (hung): no reply to {misses} pings "
                                      f"{VM_PING_S:.0f}s apart")

    async def reap_once(self) -> list[str]:
        self._flush_activity()
        now = time.time()
        expired = [r for r in self._live.values()
                   if r.state in (SandboxState.running, SandboxState.suspended) and r.in_flight == 0
                   and now - r.last_active_at > r.ttl_idle_s]
        for r in expired:
            await self.stop(r.id, reason=f"idle for more than ttl_idle_s={r.ttl_idle_s}s")
        to_park = [r for r in self._live.values()
                   if r.state == SandboxState.running and r.in_flight == 0 and r.args.get("suspend_idle_s")
                   and now - r.last_active_at > r.args["suspend_idle_s"]]
        for r in to_park:
            try:
                await self.suspend(r.id)
            except DsecError as e:   # it keeps running; the next pass retries
                log.warning("could not park idle VM", extra={"sandbox": r.id, "error": e.message})
        self.records.purge_ended(now - self.settings.keep_ended_s)
        if self.vm is not None:
            self.vm.purge_consoles(now - self.settings.keep_ended_s)
        return [r.id for r in expired]


async def _events(exec_id: str, items: AsyncIterator[Output | Exit], t0: float) -> AsyncIterator[ExecEvent]:
    """Agent output -> wire events, decoding UTF-8 incrementally so characters never split."""
    decoders = {s: codecs.getincrementaldecoder("utf-8")(errors="replace") for s in ("stdout", "stderr")}
    kept: dict[str, list[str]] = {"stdout": [], "stderr": []}
    async for item in items:
        if isinstance(item, Output):
            text = decoders[item.stream].decode(item.data)
            if text:
                kept[item.stream].append(text)
                yield ExecEvent(type=item.stream, data=text)
            continue
        for s, d in decoders.items():
            rest = d.decode(b"", final=True)
            if rest:
                kept[s].append(rest)
                yield ExecEvent(type=s, data=rest)  # type: ignore[arg-type]
        result = ExecResult(exec_id=exec_id, exit_code=item.exit_code, signal=item.signal,
                            stdout="".join(kept["stdout"]), stderr="".join(kept["stderr"]),
                            timed_out=item.timed_out, truncated=item.truncated,
                            stdout_bytes=item.stdout_total, stderr_bytes=item.stderr_total,
                            session_ended=item.session_ended, duration_s=time.monotonic() - t0)
        yield ExecEvent(type="exit", exec_id=exec_id, result=result)
        return


def _vm_end_reason(console: str) -> str:
    """Why a VM's QEMU is gone, from the end of its console (QEMU runs with -no-reboot and the
    guest with panic=-1, so a panic, a reboot and a poweroff all end the process)."""
    if "Kernel panic" in console:
        return "the guest kernel panicked"
    if "reboot: Restarting system" in console or "reboot: Power down" in console:
        return "the guest shut itself down (reboot or poweroff inside the VM)"
    return "the VM's QEMU process exited (killed, or crashed)"


def _check_path(path: str) -> None:
    if not path or "\0" in path or len(path) > 4096:
        raise InvalidArgument(f"bad path {path!r}", field="path",
                              fix="give an absolute path inside the sandbox, or one relative to its workdir")


def _map_agent_error(e: AgentError, field: str) -> DsecError:
    cls = ERRNO_TO_ERROR.get(e.errno, InvalidArgument)
    return cls(f"{e.message} ({os.strerror(e.errno) if e.errno else 'error'})", field=field,
               fix=ERRNO_FIX.get(e.errno))
