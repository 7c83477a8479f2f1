"""The edge: one per node. Admission, storage, runtime, agent channel, TTL reaping, recovery.

The apiserver talks to an edge only through the async methods of this class (in-process in
the embedded deployment; through a Ray actor or HTTP in a multi-node one), so those methods
take and return the shared wire models only.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from dsec.agent.client import AgentClient, AgentDisconnected, AgentError, DirEntry, Exit, Output
from dsec.backends.container.driver import ContainerDriver
from dsec.backends.container.spec import ContainerSpec
from dsec.backends.fncall.service import FnCallService
from dsec.config import Paths
from dsec.edge.admission import Admission
from dsec.edge.records import EdgeRecords, SandboxRecord
from dsec.edge.users import resolve_user
from dsec.images.service import ImageService
from dsec.security.netpolicy import RULESETS_FILE, Rulesets, resolve
from dsec.types import FnCallRequest, FnCallResult
from dsec.types import DEFAULT_SCRUB, PackDiffRequest
from dsec.types import (CapacityExceeded, Conflict, ContainerArgs, DsecError, ExecEvent, ExecRequest, ExecResult,
                        FileEntry, ImageInfo, InvalidArgument, NetworkPolicy, NodeStatus, NotFound, SandboxFailed,
                        SandboxInfo, SandboxState, make_sandbox_id)

log = logging.getLogger("dsec.edge")

IMAGE_CACHE_S = 2.0
LIVE = (SandboxState.creating, SandboxState.running, SandboxState.stopping)
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


@dataclass(frozen=True)
class EdgeSettings:
    node_id: str = "local"
    reap_interval_s: float = 2.0
    keep_ended_s: float = 24 * 3600      # stopped/failed records stay visible this long
    max_parallel_creates: int = 4
    fncall_project: str = "system"       # owner of the FnCall backend's warm pool containers


class Edge:
    backends = ("container", "fncall")

    def __init__(self, paths: Paths, images: ImageService, driver: ContainerDriver,
                 settings: EdgeSettings = EdgeSettings(), admission: Admission | None = None):
        self.paths = paths
        self.images = images
        self.driver = driver
        self.settings = settings
        self.node_id = settings.node_id
        self.admission = admission or Admission.for_this_host()
        self.records = EdgeRecords(paths.edge_db)
        self._live: dict[str, SandboxRecord] = {}
        self._agents: dict[str, AgentClient] = {}
        self._agent_locks: dict[str, asyncio.Lock] = {}
        self._next_chan: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._create_slots = asyncio.Semaphore(settings.max_parallel_creates)
        self._reaper: asyncio.Task | None = None
        self._image_cache: dict[str, tuple[ImageInfo, float]] = {}
        self._lower_cache: dict[str, list[Path]] = {}
        self.fncall = FnCallService(self, settings.fncall_project)
        self.rulesets = Rulesets(paths.home / RULESETS_FILE)   # operator's named network rule sets
        self._net_locks: dict[str, asyncio.Lock] = {}

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

    async def _recover(self) -> None:
        runtime = await self.driver.list_ids()
        for rec in self.records.load(LIVE):
            if rec.state == SandboxState.running and runtime.get(rec.id) == "running":
                self._live[rec.id] = rec
                continue
            reason = {SandboxState.creating: "edge restarted while creating the sandbox",
                      SandboxState.running: "the sandbox died while the edge was down"}.get(rec.state)
            await self.driver.destroy(rec.id)
            final = SandboxState.stopped if rec.state == SandboxState.stopping else SandboxState.failed
            self.records.set_state(rec.id, final, reason)
            log.warning("recovered sandbox", extra={"sandbox": rec.id, "was": rec.state.value, "now": final.value})
        # Anything the runtime or the disk holds that no live record owns is an orphan.
        on_disk = {p.name for p in self.paths.sandboxes.iterdir()} if self.paths.sandboxes.exists() else set()
        for orphan in (set(runtime) | on_disk) - set(self._live):
            log.warning("removing orphan sandbox", extra={"sandbox": orphan})
            await self.driver.destroy(orphan)
        await self.driver.recover_network(set(self._live))   # IPs, veths, BPF of the dead; re-attach the live

    # -- status for the watcher ----------------------------------------------------------
    async def status(self) -> NodeStatus:
        live = [r for r in self._live.values() if r.state != SandboxState.stopping]
        problem = self.admission.host_problem()
        return NodeStatus(node_id=self.node_id, healthy=problem is None, reason=problem,
                          backends=list(self.backends), capacity=self.admission.capacity,
                          committed_cpu_cores=sum(r.cpu_cores for r in live),
                          committed_memory_mb=sum(r.memory_mb for r in live), sandboxes=len(live))

    # -- create / get / list / stop ------------------------------------------------------
    async def create(self, project: str, args: ContainerArgs) -> SandboxInfo:
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
            self._live.pop(rec.id, None)
            await asyncio.shield(self._forget_agent(rec.id))
            await asyncio.shield(self.driver.destroy(rec.id))
            self.records.set_state(rec.id, SandboxState.failed, f"creation failed: {e}")
            log.error("create failed", extra={"sandbox": rec.id, "error": str(e)})
            if isinstance(e, DsecError):
                raise
            raise SandboxFailed(f"sandbox creation failed: {e}") from e
        rec.state = SandboxState.running
        self.records.set_state(rec.id, SandboxState.running)
        log.info("sandbox created", extra={"sandbox": rec.id, "image": args.image, "project": project})
        return rec.info(self.node_id)

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
        self._touch(rec)
        parents = []
        if rec.args.get("workspace"):
            parents.append(await self._resolve_image(rec.args["workspace"], "workspace"))
        scrub = list(DEFAULT_SCRUB if req.scrub is None else req.scrub)
        upper = self.driver.sandbox_dir(rec.id) / "upper"
        rec.in_flight += 1      # not reaped while packing
        # Frozen while its upper dir is read on the host: otherwise the sandbox could swap a
        # directory for a symlink mid-walk and have host files copied into the layer.
        await self.driver.pause(rec.id)
        try:
            info = await asyncio.to_thread(
                self.images.pack_upper, req.name, upper, parents=parents, scrub=scrub,
                source=f"pack_diff:{rec.id}:base={rec.image_digest}", replace=req.replace)
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

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self._record(sandbox_id).info(self.node_id)

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
                await self.driver.set_network(rec.id, allows)
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
        await self.driver.destroy(rec.id)
        rec.state, rec.error = SandboxState.stopped, reason or rec.error
        rec.ended_at = time.time()
        self.records.set_state(rec.id, SandboxState.stopped, reason)
        self._live.pop(rec.id, None)
        log.info("sandbox stopped", extra={"sandbox": rec.id, "reason": reason or "requested"})
        return rec.info(self.node_id)

    async def _fail(self, rec: SandboxRecord, reason: str) -> None:
        await self._forget_agent(rec.id)
        tail = self._init_log_tail(rec.id)
        await self.driver.destroy(rec.id)
        rec.state, rec.error, rec.ended_at = SandboxState.failed, reason + tail, time.time()
        self.records.set_state(rec.id, SandboxState.failed, rec.error)
        self._live.pop(rec.id, None)
        log.error("sandbox failed", extra={"sandbox": rec.id, "reason": rec.error})

    def _init_log_tail(self, sandbox_id: str) -> str:
        p = self.driver.sandbox_dir(sandbox_id) / "run" / "init.log"
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
                agent = await AgentClient.connect(self.driver.agent_socket(rec.id))
                execs = await agent.list_execs()
                # chans still retained by the agent (from before an edge restart) are not reused
                self._next_chan[rec.id] = max([c for c, _ in execs] + [self._next_chan.get(rec.id, 0)]) + 1
                self._agents[rec.id] = agent
            return agent

    async def _forget_agent(self, sandbox_id: str) -> None:
        agent = self._agents.pop(sandbox_id, None)
        self._agent_locks.pop(sandbox_id, None)
        self._net_locks.pop(sandbox_id, None)
        if agent is not None:
            await agent.close()

    @asynccontextmanager
    async def _use(self, sandbox_id: str):
        """An agent for a running sandbox; marks activity; turns a dead channel into a failure."""
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
        if not await self.driver.is_running(rec.id):
            await self._fail(rec, f"sandbox process exited ({cause.__class__.__name__})")
            raise SandboxFailed(f"sandbox {rec.id} failed: {rec.error}", field="sandbox_id",
                                fix="create a new sandbox") from cause

    def _touch(self, rec: SandboxRecord) -> None:
        rec.last_active_at = time.time()
        self._dirty.add(rec.id)

    def _flush_activity(self) -> None:
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
            env = {**rec.args.get("env", {}), **req.env}
            try:   # sent before "start" is announced: a restarted edge can then attach to it
                events = await agent.start_exec(
                    chan, cmd=req.cmd, uid=uid, gid=gid, cwd=req.cwd, env=env,
                    timeout_ms=int(req.timeout_s * 1000), cap=cap, session=req.session,
                    stdin=req.stdin.encode() if req.stdin is not None else None)
            except AgentError as e:
                raise _map_agent_error(e, "cmd") from e
            yield ExecEvent(type="start", exec_id=str(chan))
            try:
                async for ev in _events(str(chan), events, time.monotonic()):
                    yield ev
            except AgentError as e:   # could not start (EAGAIN at pids_limit, EBUSY session ...)
                raise _map_agent_error(e, "session" if e.errno == 16 else "cmd") from e
            await agent.release(chan)

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

    # -- FnCall backend: calls run in warm pool containers (dsec.backends.fncall) ------------
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
            except Exception:  # the reaper must outlive any single bad sandbox
                log.exception("reaper iteration failed")

    async def _poll_disk(self) -> None:
        """Fallback disk quota (no kernel quota on this node, see backends/container/disk.py):
        every DISK_POLL_S, measure each running sandbox's writable layer and fail the ones
        beyond disk_mb, saying so in their error."""
        if getattr(self.driver, "disk_enforced", True) or time.monotonic() < getattr(self, "_disk_next", 0.0):
            return
        self._disk_next = time.monotonic() + DISK_POLL_S
        for rec in [r for r in self._live.values() if r.state == SandboxState.running]:
            limit = int(rec.args.get("disk_mb", 10240)) << 20
            used = await asyncio.to_thread(self.driver.disk_usage, rec.id)
            if used > limit and rec.state == SandboxState.running:
                await self._fail(rec, f"disk quota exceeded: the writable layer holds {used >> 20} MiB, "
                                      f"more than disk_mb={limit >> 20}")

    async def reap_once(self) -> list[str]:
        self._flush_activity()
        now = time.time()
        expired = [r for r in self._live.values()
                   if r.state == SandboxState.running and r.in_flight == 0
                   and now - r.last_active_at > r.ttl_idle_s]
        for r in expired:
            await self.stop(r.id, reason=f"idle for more than ttl_idle_s={r.ttl_idle_s}s")
        self.records.purge_ended(now - self.settings.keep_ended_s)
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


def _check_path(path: str) -> None:
    if not path or "\0" in path or len(path) > 4096:
        raise InvalidArgument(f"bad path {path!r}", field="path",
                              fix="give an absolute path inside the sandbox, or one relative to its workdir")


def _map_agent_error(e: AgentError, field: str) -> DsecError:
    cls = ERRNO_TO_ERROR.get(e.errno, InvalidArgument)
    return cls(f"{e.message} ({os.strerror(e.errno) if e.errno else 'error'})", field=field,
               fix=ERRNO_FIX.get(e.errno))
