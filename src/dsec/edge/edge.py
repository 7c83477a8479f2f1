"""The edge: one per node. Admission, storage, runtime, agent channel, TTL reaping, recovery.

The apiserver talks to an edge only through the async methods of this class (in-process in
the embedded deployment; through a Ray actor or HTTP in a multi-node one), so those methods
take and return the shared wire models only.

The edge knows backends only through `dsec.backends.base`: the core every backend has, and
capability interfaces for verbs only some have, checked in `_capability` (one place, one
error). Each live sandbox is one `LiveSandbox` (live.py), freed in one place (`_teardown`).
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Hashable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from dsec.agent.client import INTERNAL_CHAN_BASE, AgentClient, AgentDisconnected, AgentError, DirEntry, ExecLost
from dsec.backends.base import (PARKED, RUNNING, Backend, Console, Egress, Hibernation, LayerDiff, LivenessWatched,
                                MemoryUsage, Parking, PortIngress, Prepared, Reclaim, Snapshots)
from dsec.backends.warm import WarmClaim
from dsec.config import Paths
from dsec.edge import output_budget
from dsec.edge.admission import Admission
from dsec.edge.agent_errors import check_path, map_agent_error, watch_error
from dsec.edge.exec_events import exec_events
from dsec.edge.deadlines import Deadlines
from dsec.edge.exec_tracker import TrackedExec, now_utc
from dsec.edge.live import LiveSandbox
from dsec.edge.load import NodeLoad
from dsec.edge.reclaim import Reclaimer
from dsec.edge.warm_pool import ENV as WARM_ENV
from dsec.edge.warm_pool import PoolTarget, WarmPools, WarmSandbox, parallel_from_env, parse_targets
from dsec.edge.records import EdgeRecords, SandboxRecord
from dsec.images.service import ImageService
from dsec.images.stacks import Stacks
from dsec.placement.locality import CacheSummary
from dsec.security.users import resolve_user
from dsec.types import (DEFAULT_SCRUB, MAX_TTL_S, BulkItem, CapacityExceeded, Conflict, ContainerArgs, DsecError, ExecEvent, ExecInfo, ExecRequest, ExecResult, FileEntry, FsEvent, ImageInfo,
                        InvalidArgument, NetworkPolicy, NodeStatus, NotFound, PackDiffRequest, SandboxArgs,
                        SandboxFailed, SandboxInfo, SandboxState, SnapshotInfo, Unavailable, make_sandbox_id,
                        make_snapshot_id)

log = logging.getLogger("dsec.edge")

LIVE = (SandboxState.creating, SandboxState.running, SandboxState.suspended, SandboxState.stopping)
DISK_POLL_S = float(os.environ.get("DSEC_DISK_POLL_S", "10"))   # fallback quota check interval
BULK_PARALLEL = 16        # parks/resumes of one bulk call at a time (each reclaims memory: I/O- and CPU-bound)
PURGE_EVERY_S = 60.0      # ended records and what they left are forgotten at most this often
MAX_WATCHES_PER_PROJECT = 256   # open directory watches of one project on this node (16 a sandbox: the agent's)
# Warm pool sandboxes while they wait (warm_pool.py): the node's own, counted by admission at
# this size; a claim gives them the claimer's limits.
WARM_PROJECT = "system"
WARM_LABEL = "dsec.warm-pool"
WARM_CPU_CORES = 1.0
WARM_MEMORY_MB = 256
# Push a waiting one's memory to zram (~1 MiB: the agent) at the cost of its first command
# faulting it back in; off by default: the pool exists for that first command's latency.
WARM_RECLAIM = os.environ.get("DSEC_WARM_POOL_RECLAIM", "0") == "1"


def _park_after(rec: SandboxRecord) -> int | None:
    """Idle seconds after which the sandbox is parked (None: never)."""
    return rec.args.suspend_idle_s
Cap = TypeVar("Cap")


@dataclass(frozen=True)
class EdgeSettings:
    node_id: str = "local"
    reap_interval_s: float = 2.0
    keep_ended_s: float = 24 * 3600      # stopped/failed records stay visible this long
    max_parallel_creates: int = 4
    services: tuple[str, ...] = ()       # backends served beside the edge on this node (e.g. "fncall")


class Edge:
    def __init__(self, paths: Paths, images: ImageService, backends: Sequence[Backend],
                 settings: EdgeSettings = EdgeSettings(), admission: Admission | None = None,
                 unavailable: Mapping[str, tuple[str, str | None]] | None = None):
        self.paths = paths
        self.images = images
        self.stacks = Stacks(images)
        self._backends: dict[str, Backend] = {kind: b for b in backends for kind in b.kinds}
        self._unavailable = dict(unavailable or {})   # backend kind -> (why this node lacks it, fix)
        self.settings = settings
        self.node_id = settings.node_id
        self.admission = admission or Admission.for_this_host(paths.home)   # + its disks' reserves
        self.records = EdgeRecords(paths.edge_db)
        self._live: dict[str, LiveSandbox] = {}
        self._dirty: set[str] = set()          # activity and output counters to flush
        self._create_slots = asyncio.Semaphore(settings.max_parallel_creates)
        self._reaper: asyncio.Task[None] | None = None
        self._exit_tasks: set[asyncio.Task[None]] = set()   # failing sandboxes whose runtime exited
        self._next_ping: dict[int, float] = {}   # per LivenessWatched backend (by id())
        self._disk_next = 0.0
        self._creating_keys: dict[tuple[str, str], asyncio.Task[SandboxInfo]] = {}   # idempotent creates under way
        self._load = NodeLoad()                # committed CPU/memory of the live sandboxes, as running totals
        self._cached_images = CacheSummary()   # images this node holds: placement prefers it for them (D34)
        self._deadlines = Deadlines()          # when the reaper looks at each sandbox next (O(due) ticks)
        self._purge_next = 0.0                 # monotonic: ended records are purged once a minute
        self._watches: Counter[str] = Counter()   # open directory watches per project
        self._reclaimer = Reclaimer.from_env(self._live, self.admission.probe)   # idle memory out (reclaim.py)
        # warm pools of idle containers per environment, claimed by creates (warm_pool.py)
        self._pools = WarmPools(parse_targets(os.environ.get(WARM_ENV, "")), self._warm_start, self._warm_key_of,
                                self._warm_drop, parallel_from_env())

    # -- lifecycle of the edge itself ----------------------------------------------------
    async def start(self) -> None:
        await self._recover()
        self._reaper = asyncio.create_task(self._reap_loop(), name="edge-reaper")
        self._pools.start()     # after recovery: the pool containers of an edge that died are gone
        log.info("edge started", extra={"node": self.node_id, "sandboxes": len(self._live)})

    async def close(self) -> None:
        """Stop serving. Sandboxes keep running; a restarted edge picks them up again."""
        if self._reaper:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        await self._reclaimer.close()
        await self._pools.close()    # a cache: idle pool sandboxes are destroyed, not kept
        for live in self._live.values():
            live.backend.unwatch_exit(live.id)
        for task in list(self._exit_tasks):
            task.cancel()
        await asyncio.gather(*self._exit_tasks, return_exceptions=True)
        self._flush_activity()
        for live in list(self._live.values()):
            live.commands.close()
            await live.drop_agent()
        self.records.close()
        if not self._live:
            # Nothing uses the node's layer mounts: leave no mount behind (`dsec down`). With
            # live sandboxes they stay, so a restarted edge shares their page cache again.
            await self.stacks.unmount_all()
            for b in self._distinct_backends():
                await b.release_node()

    @property
    def backends(self) -> builtins.list[str]:
        return list(self._backends) + list(self.settings.services)

    def _distinct_backends(self) -> builtins.list[Backend]:
        """Each backend object once (one VM driver serves two kinds)."""
        return list({id(b): b for b in self._backends.values()}.values())

    def _backend(self, kind: str) -> Backend:
        b = self._backends.get(kind)
        if b is None:
            why, fix = self._unavailable.get(kind, (f"this node has no {kind!r} backend", None))
            raise Unavailable(f"backend {kind!r} is not available on node {self.node_id}: {why}", field="backend",
                              fix=fix or f"use a backend this node offers ({', '.join(self.backends)})")
        return b

    def _capability(self, rec: SandboxRecord, cap: type[Cap], verb: str) -> Cap:
        """The sandbox's backend as `cap`, or the one error for a verb its backend lacks."""
        b = self._backend(rec.backend)
        if not isinstance(b, cap):
            raise InvalidArgument(f"sandbox {rec.id}: backend {rec.backend!r} cannot {verb}", field="backend",
                                  fix=b.instead.get(verb, f"use a sandbox of a backend that can {verb}"))
        return b

    async def _recover(self) -> None:
        """Adopt what still runs, fail what does not. A sandbox (or a backend) that cannot be
        read or torn down, e.g. on a filesystem gone read-only after an I/O error, is marked
        failed with that error and logged; recovery goes on with the others."""
        runtime: dict[int, dict[str, str]] = {}
        unlisted: dict[int, str] = {}
        for each in self._distinct_backends():
            try:
                runtime[id(each)] = await each.list_ids()
            except Exception as e:
                runtime[id(each)] = {}
                unlisted[id(each)] = f"could not list the {each.kinds[0]} backend's sandboxes: {e!r}"
                log.exception("recovery could not list a backend's sandboxes", extra={"backend": each.kinds[0]})
        for rec in self.records.load(LIVE):
            b = self._backends.get(rec.backend)
            seen = runtime[id(b)].get(rec.id) if b is not None else None
            if b is not None and rec.state == SandboxState.running and seen == PARKED:
                # the edge died after a park finished, before it recorded it: parked it is
                rec.state = SandboxState.suspended
                self.records.set_state(rec.id, SandboxState.suspended)
            if b is not None and ((rec.state == SandboxState.running and seen == RUNNING)
                                  or (rec.state == SandboxState.suspended and seen == PARKED)):
                self._live[rec.id] = LiveSandbox(rec, b)   # a parked one resumes on its next request
                self._load.update(rec, live=True)
                self._schedule(rec)
                continue
            reason = {SandboxState.creating: "edge restarted while creating the sandbox",
                      SandboxState.running: "the sandbox died while the edge was down",
                      SandboxState.suspended: "the parked sandbox's saved state was lost"}.get(rec.state)
            if b is not None and id(b) in unlisted:
                reason = unlisted[id(b)]
            final = SandboxState.stopped if rec.state == SandboxState.stopping else SandboxState.failed
            if b is not None:
                try:
                    await b.destroy(rec.id)
                except Exception as e:
                    final, reason = SandboxState.failed, f"{reason or 'recovery'}; could not tear it down: {e!r}"
                    log.exception("recovery could not tear down a sandbox", extra={"sandbox": rec.id})
            self.records.set_state(rec.id, final, reason)
            log.warning("recovered sandbox", extra={"sandbox": rec.id, "was": rec.state.value, "now": final.value})
        # Anything a runtime or its disk holds that no live record owns is an orphan.
        for b in self._distinct_backends():
            for orphan in set(runtime[id(b)]) - set(self._live):
                log.warning("removing orphan sandbox", extra={"sandbox": orphan, "backend": b.kinds[0]})
                try:
                    await b.destroy(orphan)
                except Exception:
                    log.exception("could not remove an orphan sandbox", extra={"sandbox": orphan})
            try:
                await b.recover({i for i, live in self._live.items() if live.backend is b})
            except Exception:
                log.exception("backend recovery failed", extra={"backend": b.kinds[0]})
        for live in list(self._live.values()):
            if live.rec.state == SandboxState.running:
                self._watch_exit(live)

    # -- status for the watcher ----------------------------------------------------------
    async def status(self) -> NodeStatus:
        # parked sandboxes hold no CPU or memory: they do not count against admission
        # (running totals, NodeLoad: a status is O(1) however many sandboxes the node holds)
        problem = self.admission.host_problem()
        return NodeStatus(node_id=self.node_id, healthy=problem is None, reason=problem,
                          backends=self.backends, capacity=self.admission.capacity,
                          committed_cpu_cores=self._load.cpu_cores, committed_memory_mb=self._load.memory_mb,
                          sandboxes=self._load.sandboxes, pressure=self.admission.pressure(),
                          cached_images=self._cached_images.keys())

    # -- create / get / list / stop ------------------------------------------------------
    async def create(self, project: str, args: SandboxArgs) -> SandboxInfo:
        """Create a sandbox. With an idempotency key, a retry (after a timeout, a lost
        connection) returns the sandbox the first request made or is making."""
        key = args.idempotency_key
        if key is None:
            return await self._create(project, args)
        pending = self._creating_keys.get((project, key))
        if pending is None:   # registered before any await: a concurrent retry finds it
            pending = asyncio.create_task(self._create_once(project, key, args), name=f"create-{key}")
            self._creating_keys[(project, key)] = pending
            pending.add_done_callback(lambda _: self._creating_keys.pop((project, key), None))
        # shielded: a caller that gives up does not abort the creation its retry will return
        return await asyncio.shield(pending)

    async def _create_once(self, project: str, key: str, args: SandboxArgs) -> SandboxInfo:
        """The sandbox an earlier create with this key made, else a new one."""
        earlier = await asyncio.to_thread(self.records.find_idempotent, project, key)
        if earlier is not None:
            return self._record(earlier.id).info(self.node_id)
        return await self._create(project, args)

    async def _create(self, project: str, args: SandboxArgs) -> SandboxInfo:
        """One path for every backend: prepare (validate, resolve), admit, record, create,
        wait for the agent. A failure anywhere leaves a failed record and nothing else. A
        request that matches a warm pool (warm_pool.py) claims one of its idle sandboxes
        instead of starting one: same record, same checks, its limits applied at claim."""
        t0 = time.monotonic()
        backend = self._backend(args.backend)
        prepared = await backend.prepare(args, self.stacks)   # DsecErrors name the field
        args = prepared.args
        warm = self._take_warm(backend, prepared)
        if warm is not None:   # its share of the node passes to this sandbox
            self._load.update(warm.rec, live=False)
        try:
            self.admission.admit(await self.status(), args.cpu_cores, args.memory_mb)
        except BaseException:
            self._give_back_warm(warm)
            raise
        now = time.time()
        rec = SandboxRecord(id=warm.id if warm else make_sandbox_id(self.node_id), project=project,
                            backend=args.backend,
                            state=SandboxState.creating, args=args, image=args.image,
                            image_digest=prepared.image_digest, uid=prepared.uid, gid=prepared.gid,
                            created_at=now, last_active_at=now,
                            expires_at=now + args.lifetime_s if args.lifetime_s is not None else None)
        live = LiveSandbox(rec, backend)
        try:
            self.records.insert(rec)   # durable before anything exists on the host (or is claimed)
        except Exception as e:     # e.g. "database or disk is full"
            self._give_back_warm(warm)
            raise Unavailable(f"node {self.node_id} cannot record a new sandbox in {self.paths.edge_db}: {e}",
                              fix="free space on the DSEC_HOME filesystem, then retry") from e
        self._live[rec.id] = live
        self._load.update(rec, live=True)
        if prepared.image_digest:   # its layers are pulled and mounted on this node from here on
            self._cached_images.add(prepared.image_digest)
        try:
            if warm is None:
                async with self._create_slots:   # a burst starts a few at a time
                    await backend.create(rec.id, prepared, self.stacks)
                await self._adopt_agent(live)    # ready means the agent answers
            else:
                # its connected agent, the sandbox's from here (its teardown closes it); no
                # round trip: nothing ever ran in it (chan 1 is free), and a dead agent shows
                # as a closed connection (_take_warm) or fails the first request (_check_alive)
                live.agent = warm.agent
                assert isinstance(backend, WarmClaim)
                await backend.claim(rec.id, prepared)   # the caller's limits and network policy
        except BaseException as e:
            await asyncio.shield(self._abort_create(live, e))
            if isinstance(e, DsecError) or not isinstance(e, Exception):
                raise          # cancellation and interrupts go on as they are
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
                raise Unavailable(f"sandbox creation failed: node {self.node_id}'s storage: {e}",
                                  fix="free space on the node's DSEC_HOME filesystem (a read-only scratch "
                                      "filesystem needs dsec stopped, DSEC_HOME/sb unmounted and a restart)") from e
            raise SandboxFailed(f"sandbox creation failed: {e!r}") from e
        rec.state = SandboxState.running
        self.records.set_state(rec.id, SandboxState.running)
        self._watch_exit(live)
        self._schedule(rec)
        log.info("sandbox created", extra={"sandbox": rec.id, "backend": args.backend, "image": args.image,
                                           "project": project, "accel": getattr(args, "accel", None),
                                           "warm": warm is not None, "ms": round((time.monotonic() - t0) * 1000, 2)})
        return rec.info(self.node_id)

    # -- warm pools (warm_pool.py, D28) ------------------------------------------------------
    def _take_warm(self, backend: Backend, prepared: Prepared) -> WarmSandbox | None:
        """An idle pool sandbox for this request (its agent still connected), or None."""
        if not isinstance(backend, WarmClaim):
            return None
        key = backend.warm_key(prepared)
        while (w := self._pools.take(key)) is not None:
            if not w.agent.closed:
                return w
            task = asyncio.create_task(self._warm_drop(w), name=f"warm-drop-{w.id}")   # died while waiting
            self._exit_tasks.add(task)
            task.add_done_callback(self._exit_tasks.discard)
        return None

    def _give_back_warm(self, warm: WarmSandbox | None) -> None:
        if warm is not None:
            self._load.update(warm.rec, live=True)
            self._pools.give_back(warm)

    def _warm_args(self, t: PoolTarget) -> ContainerArgs:
        # memory_mb 256: the agent's retained-output bound and /dev/shm are then those of any
        # request of 256 MiB or more (claim.py); limits are the claimer's from the claim on
        return ContainerArgs(image=t.image, cpu_cores=WARM_CPU_CORES, memory_mb=WARM_MEMORY_MB,
                             ttl_idle_s=MAX_TTL_S, labels={WARM_LABEL: t.image})

    async def _warm_prepared(self, t: PoolTarget) -> tuple[Backend, Prepared, Hashable | None]:
        backend = self._backend("container")
        prepared = await backend.prepare(self._warm_args(t), self.stacks)
        key = backend.warm_key(prepared) if isinstance(backend, WarmClaim) else None
        return backend, prepared, key

    async def _warm_key_of(self, t: PoolTarget) -> Hashable | None:
        return (await self._warm_prepared(t))[2]

    async def _warm_start(self, t: PoolTarget) -> WarmSandbox:
        """Start one idle pool sandbox: prepared, admitted and counted like any other (as the
        node's own), no record (a cache: orphans after a crash, destroyed at the next start)."""
        backend, prepared, key = await self._warm_prepared(t)
        if key is None:
            raise InvalidArgument(f"image {t.image!r} cannot have a warm pool on node {self.node_id}",
                                  field=WARM_ENV, fix="use a container image")
        args = prepared.args
        self.admission.admit(await self.status(), args.cpu_cores, args.memory_mb)
        now = time.time()
        rec = SandboxRecord(id=make_sandbox_id(self.node_id), project=WARM_PROJECT, backend=args.backend,
                            state=SandboxState.running, args=args, image=args.image,
                            image_digest=prepared.image_digest, uid=prepared.uid, gid=prepared.gid,
                            created_at=now, last_active_at=now)
        self._load.update(rec, live=True)
        try:
            await backend.create(rec.id, prepared, self.stacks)
            agent = await backend.wait_agent(rec.id)
        except BaseException:
            self._load.update(rec, live=False)
            await asyncio.shield(backend.destroy(rec.id))
            raise
        if WARM_RECLAIM and isinstance(backend, Reclaim):   # cheap while it waits: what the agent touched goes to zram
            try:
                await backend.reclaim(rec.id)
            except DsecError as e:
                log.debug("could not reclaim a warm sandbox's memory", extra={"sandbox": rec.id, "error": e.message})
        log.info("warm sandbox ready", extra={"sandbox": rec.id, "image": t.image})
        return WarmSandbox(rec=rec, key=key, backend=backend, agent=agent)

    async def _warm_drop(self, w: WarmSandbox) -> None:
        self._load.update(w.rec, live=False)
        await w.agent.close()
        await w.backend.destroy(w.id)

    async def warm_pools(self) -> dict[str, Any]:
        """The node's warm pools: per image its size, idle and starting sandboxes, last error."""
        return self._pools.status()

    async def set_warm_pools(self, spec: str) -> dict[str, Any]:
        """Reconfigure the pools ('image:size,...'; '' for none); refilled or drained in the background."""
        self._pools.set_targets(parse_targets(spec, field="pools"))
        return self._pools.status()

    async def _abort_create(self, live: LiveSandbox, error: BaseException) -> None:
        """A creation that failed leaves nothing: no agent channel, no runtime, a failed record
        (failed even when the teardown fails too, e.g. on a broken disk: it says so)."""
        reason = f"creation failed: {error!s}"
        try:
            await self._teardown(live)
        except Exception as e:
            reason += f"; its teardown failed too: {e!r}"
            log.exception("teardown after a failed create failed", extra={"sandbox": live.id})
        live.rec.state = SandboxState.failed
        try:
            self.records.set_state(live.id, SandboxState.failed, reason)
        except Exception:   # the record stays `creating`: the next start's recovery fails it
            log.exception("could not record a failed create", extra={"sandbox": live.id})
        log.error("create failed", extra={"sandbox": live.id, "error": str(error) or repr(error)})

    async def _adopt_agent(self, live: LiveSandbox) -> None:
        """First connection after a start or resume, then the backend's own readiness step
        (a restored VM gets its clock and entropy: it copies another guest, or stood still)."""
        agent = await live.backend.wait_agent(live.id)
        await live.adopt(agent)
        await live.backend.ready(live.id, agent)

    async def _teardown(self, live: LiveSandbox) -> None:
        """Free everything of a sandbox: the edge's side (live object, agent) and the backend's."""
        self._live.pop(live.id, None)
        self._load.update(live.rec, live=False)
        self._deadlines.forget(live.id)
        await live.close()
        await live.backend.destroy(live.id)

    def _record(self, sandbox_id: str) -> SandboxRecord:
        live = self._live.get(sandbox_id)
        rec = live.rec if live is not None else self.records.get(sandbox_id)
        if rec is None:
            raise NotFound(f"no sandbox {sandbox_id!r} on node {self.node_id}", field="sandbox_id",
                           fix="list sandboxes with `dsec sandbox ls`; stopped ones are forgotten after a day")
        return rec

    def _running(self, sandbox_id: str) -> LiveSandbox:
        rec = self._record(sandbox_id)
        live = self._live.get(sandbox_id)
        if rec.state != SandboxState.running or live is None:
            raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}" + (f": {rec.error}" if rec.error else ""),
                           field="sandbox_id", fix="create a new sandbox")
        return live

    async def get(self, sandbox_id: str, usage: bool = False) -> SandboxInfo:
        """The sandbox's record; with `usage`, also what it costs the host now (a /proc read:
        not for the ownership check every request makes)."""
        rec = self._record(sandbox_id)
        info = rec.info(self.node_id)
        live = self._live.get(sandbox_id)
        if (usage and live is not None and rec.state in (SandboxState.running, SandboxState.suspended)
                and isinstance(live.backend, MemoryUsage)):
            b = live.backend
            pss, swapped = await asyncio.to_thread(lambda: (b.pss(rec.id), b.swapped(rec.id)))
            mib = lambda n: round(n / (1 << 20), 1) if n is not None else None  # noqa: E731
            info.host_pss_mb, info.host_swap_mb = mib(pss), mib(swapped)
        return info

    async def list(self, project: str | None = None, include_ended: bool = False) -> builtins.list[SandboxInfo]:
        recs = self.records.load() if include_ended else [x.rec for x in self._live.values()]
        # live records carry fresher state/activity than the database
        recs = [self._live[r.id].rec if r.id in self._live else r for r in recs]
        return [r.info(self.node_id) for r in recs if project is None or r.project == project]

    async def resolve_image(self, name: str, field: str = "image") -> ImageInfo:
        """An image by name (cached briefly), NotFound naming `field`."""
        return await self.stacks.resolve(name, field)

    async def stop(self, sandbox_id: str, reason: str | None = None) -> SandboxInfo:
        rec = self._record(sandbox_id)
        if rec.state in (SandboxState.stopped, SandboxState.failed):
            return rec.info(self.node_id)
        rec.state = SandboxState.stopping
        self._load.update(rec, live=rec.id in self._live)
        self.records.set_state(rec.id, SandboxState.stopping)
        live = self._live.get(rec.id)
        if live is not None:
            await self._teardown(live)
        rec.state, rec.error = SandboxState.stopped, reason or rec.error
        rec.ended_at = time.time()
        self.records.set_state(rec.id, SandboxState.stopped, reason)
        log.info("sandbox stopped", extra={"sandbox": rec.id, "reason": reason or "requested"})
        return rec.info(self.node_id)

    async def _fail(self, live: LiveSandbox, reason: str) -> None:
        rec = live.rec
        if rec.state == SandboxState.failed:
            return                                  # already failed by another path
        # state first: requests woken by the teardown below must already see why
        rec.state, rec.error, rec.ended_at = SandboxState.failed, reason + live.backend.log_tail(rec.id), time.time()
        self.records.set_state(rec.id, SandboxState.failed, rec.error)
        await self._teardown(live)
        log.error("sandbox failed", extra={"sandbox": rec.id, "reason": rec.error})

    def _watch_exit(self, live: LiveSandbox) -> None:
        """Notice the sandbox's death between requests where its backend can watch its runtime:
        it is failed with the backend's end_reason() at once (no longer admitted, no 'idle')."""
        live.backend.watch_exit(live.id, lambda: self._exited(live))

    def _exited(self, live: LiveSandbox) -> None:
        if self._live.get(live.id) is not live or live.rec.state != SandboxState.running:
            return                          # stopping, parked or gone: not news
        task = asyncio.create_task(self._fail_exited(live), name=f"exited-{live.id}")
        self._exit_tasks.add(task)
        task.add_done_callback(self._exit_tasks.discard)

    async def _fail_exited(self, live: LiveSandbox) -> None:
        try:
            if live.rec.state == SandboxState.running and not await live.backend.is_running(live.id):
                await self._fail(live, live.backend.end_reason(live.id, None))
        except Exception:
            log.exception("could not fail an exited sandbox", extra={"sandbox": live.id})

    # -- verbs of some backends (capabilities) ---------------------------------------------
    async def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        """Replace a running sandbox's egress policy; new connections see it immediately."""
        live = self._running(sandbox_id)
        egress = self._capability(live.rec, Egress, "set_network")
        async with live.net_lock:
            try:
                await egress.set_network(live.id, policy)
            except FileNotFoundError as e:   # stopped (or died) under us
                raise Conflict(f"sandbox {live.id} is {live.rec.state.value}", field="sandbox_id",
                               fix="create a new sandbox") from e
            live.rec.args = live.rec.args.model_copy(update={"network": policy})
            self.records.set_args(live.id, live.rec.args)
        self._touch(live.rec)
        log.info("network policy replaced", extra={"sandbox": live.id, "rules": len(policy.rules)})
        return live.rec.info(self.node_id)

    async def pack_diff(self, sandbox_id: str, req: PackDiffRequest) -> ImageInfo:
        """The sandbox's writable changes (additions, modifications, whiteouts, opaque dirs),
        minus the scrub list, as a new workspace layer stacked on the workspace the sandbox
        started from."""
        live = self._running(sandbox_id)
        diff = self._capability(live.rec, LayerDiff, "pack_diff")
        rec = live.rec
        self._touch(rec)
        workspace = getattr(rec.args, "workspace", None)
        parents = [await self.stacks.resolve(workspace, "workspace")] if workspace else []
        scrub = list(DEFAULT_SCRUB if req.scrub is None else req.scrub)
        rec.in_flight += 1      # not reaped while packing
        try:
            # the node's heavy-work lane (bounded, own threads): creations never queue behind it
            async with self.images.heavy.slot(rec.project), diff.frozen_upper(rec.id) as upper:
                disk_mb = getattr(rec.args, "disk_mb", None)   # a layer is bounded by its sandbox's quota
                info = await self.images.heavy.run(
                    self.images.pack_upper, req.name, upper.path, parents=parents, scrub=scrub,
                    source=f"pack_diff:{rec.id}:base={rec.image_digest}", replace=req.replace, map_id=upper.map_id,
                    max_bytes=disk_mb << 20 if disk_mb else None, owner=rec.project)
        finally:
            rec.in_flight -= 1
            self._touch(rec)
        self.stacks.forget(req.name)
        log.info("pack_diff", extra={"sandbox": rec.id, "layer": req.name, "digest": info.digest})
        return info

    async def resolve_images(self, refs: builtins.list[tuple[str, str]]) -> builtins.list[ImageInfo]:
        """The image each (field, name) means on this node, owner included, as a create here
        would resolve it (the same cache); NotFound naming the field for a missing one. An
        apiserver without the node's registry checks tenancy with it (control._place)."""
        return [await self.stacks.resolve(name, field) for field, name in refs]

    async def snapshot(self, sandbox_id: str) -> SnapshotInfo:
        """Save a running sandbox so it can be restored as new sandboxes (`snapshot=` in its args)."""
        live = self._running(sandbox_id)
        snaps = self._capability(live.rec, Snapshots, "snapshot")
        rec = live.rec
        self._touch(rec)
        snap_id = make_snapshot_id(self.node_id)
        rec.in_flight += 1
        try:
            size = await snaps.snapshot(rec.id, snap_id, {"image": rec.image, "image_digest": rec.image_digest,
                                                          "project": rec.project, "created_at": time.time()})
        finally:
            rec.in_flight -= 1
        log.info("snapshot", extra={"sandbox": rec.id, "snapshot": snap_id, "bytes": size})
        return await self.get_snapshot(snap_id)

    def _snapshot_backends(self) -> builtins.list[Snapshots]:
        return [b for b in self._distinct_backends() if isinstance(b, Snapshots)]

    def _snapshot_info(self, r: dict[str, Any]) -> SnapshotInfo:
        return SnapshotInfo(node=self.node_id, **{**r, "created_at": datetime.fromtimestamp(r["created_at"], timezone.utc)})

    def _find_snapshot(self, snapshot_id: str) -> tuple[Snapshots, dict[str, Any]]:
        """The backend holding the snapshot, and its record (file reads: call in a thread)."""
        for b in self._snapshot_backends():
            try:
                return b, b.snapshot_record(snapshot_id)
            except NotFound:
                continue
        raise NotFound(f"no snapshot {snapshot_id!r} on node {self.node_id}", field="snapshot_id",
                       fix="use an id returned by Sandbox.snapshot(); list them with `dsec vm snapshot ls`")

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        _, record = await asyncio.to_thread(self._find_snapshot, snapshot_id)
        return self._snapshot_info(record)

    async def list_snapshots(self, project: str | None = None) -> builtins.list[SnapshotInfo]:
        out: builtins.list[SnapshotInfo] = []
        for b in self._snapshot_backends():
            out += [self._snapshot_info(r) for r in await asyncio.to_thread(b.snapshot_records)
                    if project is None or r["project"] == project]
        return out

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove a snapshot. Sandboxes restored from it keep running and restoring: they hold
        their own links to what they need of it."""
        owner, _ = await asyncio.to_thread(self._find_snapshot, snapshot_id)
        await owner.delete_snapshot(snapshot_id)
        log.info("snapshot deleted", extra={"snapshot": snapshot_id})

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        """Park a sandbox: off the CPU, its memory freed, its state kept. Its next request (or
        resume()) brings it back where it was, running commands included."""
        live = self._running(sandbox_id)
        parking = self._capability(live.rec, Parking, "suspend")
        async with live.park_lock:
            if live.rec.state != SandboxState.running:
                return live.rec.info(self.node_id)
            live.backend.unwatch_exit(live.id)    # parking stops its runtime on purpose
            # tracked execs read the connection dropped below: let go of the running ones (the
            # agent keeps their output; exec_follow/attach re-attach there after the resume)
            for exec_id, t in list(live.commands.tracked.items()):
                if not t.done and t.task is not None:
                    del live.commands.tracked[exec_id]
                    t.error = Unavailable(f"sandbox {live.id} was suspended while exec {exec_id} was followed; "
                                          "it runs on", field="exec_id", fix="follow or attach it again")
                    t.task.cancel()
            to_disk = live.backend if isinstance(live.backend, Hibernation) and await self._quiescent_agent(live) else None
            await live.drop_agent()
            try:
                size = await to_disk.hibernate(live.id) if to_disk is not None else None
                if size is None:
                    size = await parking.park(live.id)
            except BaseException:
                self._watch_exit(live)        # it runs on (a park that failed undoes itself)
                raise
            live.rec.state = SandboxState.suspended
            self._load.update(live.rec, live=True)
            self.records.set_state(live.id, SandboxState.suspended)
        log.info("sandbox parked", extra={"sandbox": live.id, "bytes": size})
        return live.rec.info(self.node_id)

    async def _quiescent_agent(self, live: LiveSandbox) -> bool:
        """Whether the sandbox may be parked to disk as far as the edge can tell: no request is
        using it, and its agent keeps no exec (running, or finished with output nobody
        collected: a fresh agent would not have it). The backend (Hibernation) then checks
        that nothing but the agent runs in it."""
        if live.execs or live.rec.in_flight:
            return False
        try:
            return not await (await live.connect()).list_execs()
        except (DsecError, OSError, AgentError):
            return False

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Bring a parked sandbox back (no-op for a running one)."""
        rec = self._record(sandbox_id)
        live = self._live.get(sandbox_id)
        if live is None:
            return rec.info(self.node_id)
        async with live.park_lock:
            if rec.state == SandboxState.suspended:
                parking = self._capability(rec, Parking, "resume")
                self.admission.admit(await self.status(), rec.cpu_cores, rec.memory_mb)
                t0 = time.monotonic()
                try:
                    await parking.unpark(rec.id)
                    await self._adopt_agent(live)
                except DsecError as e:
                    await self._fail(live, f"could not resume the parked sandbox: {e.message}")
                    raise
                rec.state = SandboxState.running
                self._load.update(rec, live=True)
                self.records.set_state(rec.id, SandboxState.running)
                self._watch_exit(live)
                self._schedule(rec)
                log.info("sandbox resumed", extra={"sandbox": rec.id, "seconds": round(time.monotonic() - t0, 3)})
        self._touch(rec)
        return rec.info(self.node_id)

    async def suspend_many(self, sandbox_ids: builtins.list[str]) -> builtins.list[BulkItem]:
        """Park many at once (trainer preemption), BULK_PARALLEL at a time; each one's outcome."""
        return await self._bulk(sandbox_ids, self.suspend)

    async def resume_many(self, sandbox_ids: builtins.list[str]) -> builtins.list[BulkItem]:
        return await self._bulk(sandbox_ids, self.resume)

    async def _bulk(self, sandbox_ids: builtins.list[str], verb: Any) -> builtins.list[BulkItem]:
        slots = asyncio.Semaphore(BULK_PARALLEL)

        async def one(sid: str) -> BulkItem:
            async with slots:
                try:
                    info = await verb(sid)
                    return BulkItem(id=sid, state=info.state)
                except DsecError as e:
                    live = self._live.get(sid)
                    return BulkItem(id=sid, state=live.rec.state if live is not None else None, error=e.message)
        return builtins.list(await asyncio.gather(*(one(s) for s in sandbox_ids)))

    async def console(self, sandbox_id: str, tail: int = 65536) -> bytes:
        """The end of a sandbox's console log (kept while the record is, failed ones included)."""
        rec = self._record(sandbox_id)
        console = self._capability(rec, Console, "console")
        return await asyncio.to_thread(console.console, rec.id, tail)

    # -- the agent channel ------------------------------------------------------------------
    async def _check_alive(self, live: LiveSandbox, cause: BaseException) -> None:
        rec = live.rec
        if rec.state == SandboxState.failed:       # failed meanwhile (e.g. a hung VM)
            raise SandboxFailed(f"sandbox {rec.id} failed: {rec.error}", field="sandbox_id",
                                fix="create a new sandbox") from cause
        if not await live.backend.is_running(rec.id):
            await self._fail(live, live.backend.end_reason(rec.id, cause))
            raise SandboxFailed(f"sandbox {rec.id} failed: {rec.error}", field="sandbox_id",
                                fix="create a new sandbox") from cause

    def _touch(self, rec: SandboxRecord) -> None:
        rec.last_active_at = time.time()
        self._dirty.add(rec.id)

    def _flush_activity(self) -> None:
        """Activity times and output counters of the sandboxes used since the last flush, in
        one write (an exec must not cost a SQLite write of its own)."""
        items = [(live.rec.last_active_at, live.rec.output_used_bytes, i)
                 for i in self._dirty if (live := self._live.get(i)) is not None]
        self._dirty.clear()
        if items:
            self.records.flush_activity(items)

    @asynccontextmanager
    async def _use(self, sandbox_id: str) -> AsyncIterator[tuple[LiveSandbox, AgentClient]]:
        """An agent for a running sandbox; marks activity; turns a dead channel into a failure.
        A parked sandbox is resumed first: callers never see `suspended`."""
        live = await self._live_resumed(sandbox_id)
        with self._busy(live.rec):
            try:
                try:
                    agent = await live.connect()
                except (OSError, AgentDisconnected, asyncio.TimeoutError) as e:
                    await self._check_alive(live, e)
                    raise
                yield live, agent
            except AgentDisconnected as e:
                await self._check_alive(live, e)
                # a dying sandbox closes the channel a moment before its runtime is seen to exit (exit
                # watch, crun state): look again shortly, so the caller gets the real reason
                await asyncio.sleep(0.3)
                await self._check_alive(live, e)
                raise SandboxFailed(f"lost the channel to sandbox {sandbox_id}'s agent; retry the request",
                                    fix="retry; if it persists the sandbox is marked failed") from e

    @contextmanager
    def _busy(self, rec: SandboxRecord) -> Iterator[None]:
        """The sandbox is in use meanwhile: never idle-reaped, parked or reclaimed; activity marked
        at both ends."""
        rec.in_flight += 1
        self._touch(rec)
        try:
            yield
        finally:
            rec.in_flight -= 1
            self._touch(rec)

    @asynccontextmanager
    async def agent_channel(self, sandbox_id: str) -> AsyncIterator[tuple[AgentClient, int]]:
        """(agent, exec chan) of a running sandbox, for a service that drives the agent itself
        (FnCall's long-lived zygote exec). The sandbox counts as busy while this is held."""
        async with self._use(sandbox_id) as (live, agent):
            yield agent, live.take_chan()

    # -- exec ------------------------------------------------------------------------------
    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """start, stdout/stderr chunks as they arrive, then exit with the full ExecResult. With an
        idempotency key the edge follows the command itself: a retry follows the same one."""
        if req.idempotency_key is not None:
            tracked = await self._start_tracked(sandbox_id, req, detached=False)
            # exec_follow: the tracker, or the agent if the edge let go of it (a park, a restart)
            async for ev in self.exec_follow(sandbox_id, tracked.info.exec_id):
                yield ev
            return
        info = self._exec_info(req, detached=False)
        async for ev in self._exec_events(sandbox_id, req, info, tracked=False):
            yield ev

    @staticmethod
    def _exec_info(req: ExecRequest, detached: bool) -> ExecInfo:
        return ExecInfo(exec_id="", cmd=req.cmd, cwd=req.cwd, env=dict(req.env), tag=req.tag, session=req.session,
                        detached=detached, stdin_open=req.keep_stdin, started_at=now_utc())

    async def _exec_events(self, sandbox_id: str, req: ExecRequest, info: ExecInfo,
                           tracked: bool) -> AsyncIterator[ExecEvent]:
        async with self._use(sandbox_id) as (live, agent):
            rec = live.rec
            chan = live.take_chan()
            uid, gid = resolve_user(req.user) if req.user else (rec.uid, rec.gid)
            cap = req.output_cap_bytes or rec.args.output_cap_bytes
            # the sandbox's lifetime output budget (output_budget.py) may shrink this cap
            grant = output_budget.reserve(rec, cap)
            delivered = 0                # once started: all, unless the exit result says less
            env = {**rec.args.env, **req.env}
            try:
                # bounded per sandbox (count and output reserved): 429 + Retry-After beyond
                with live.exec_slot(grant.reserved):
                    try:   # sent before "start" is announced: a restarted edge can then attach to it
                        events = await agent.start_exec(
                            chan, cmd=req.cmd, uid=uid, gid=gid, cwd=req.cwd, env=env,
                            timeout_ms=int(req.timeout_s * 1000), cap=grant.per_stream, session=req.session,
                            stdin=req.stdin.encode() if req.stdin is not None else None,
                            keep_stdin=req.keep_stdin)
                    except AgentError as e:
                        raise map_agent_error(e, "cmd") from e
                    delivered = grant.reserved
                    info.exec_id = str(chan)
                    if not tracked:     # listed (list_execs) while it runs; tracked ones are kept apart
                        live.commands.running[info.exec_id] = info
                    yield ExecEvent(type="start", exec_id=str(chan))
                    try:
                        async for ev in exec_events(str(chan), events, time.monotonic()):
                            if ev.type == "exit" and ev.result is not None:
                                r = ev.result
                                delivered = min(r.stdout_bytes, grant.per_stream) + min(r.stderr_bytes, grant.per_stream)
                                r.output_budget_exhausted = grant.exhausted and (r.truncated or grant.per_stream == 0)
                                # the result is in hand: the agent frees its copy now, before the
                                # exit event (run() and other callers stop iterating there)
                                try:
                                    await agent.release(chan)
                                except AgentDisconnected:
                                    pass          # gone with the connection; the agent's -R bounds it
                            yield ev
                    except AgentError as e:   # could not start (EAGAIN at pids_limit, EBUSY session ...)
                        delivered = 0
                        raise map_agent_error(e, "session" if e.errno == 16 else "cmd") from e
                    except ExecLost as e:
                        raise SandboxFailed(f"exec {chan} in sandbox {rec.id} ended without a result: {e}",
                                            field="exec_id", fix="run the command again") from e
            finally:
                live.commands.running.pop(info.exec_id, None)
                output_budget.settle(rec, grant, delivered)
                self._dirty.add(rec.id)

    async def run(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        async for ev in self.exec_stream(sandbox_id, req):
            if ev.type == "exit":
                if ev.result is None:     # a followed (idempotent) exec that was lost
                    raise SandboxFailed(f"the command ended without a result: {ev.data}", field="cmd",
                                        fix="run it again")
                return ev.result
        raise SandboxFailed("exec ended without an exit status")

    async def _start_tracked(self, sandbox_id: str, req: ExecRequest, detached: bool) -> TrackedExec:
        """Start a command the edge follows itself (or find the one an earlier request with the
        same idempotency key started); returns once it runs (errors starting it are raised)."""
        live = await self._live_resumed(sandbox_id)
        key = req.idempotency_key
        tracked = live.commands.by_key.get(key) if key is not None else None
        if tracked is None:
            info = self._exec_info(req, detached)
            tracked = live.commands.start_tracking(
                info, key, lambda t: self._exec_events(sandbox_id, req, t.info, tracked=True))
        await tracked.started.wait()
        if not tracked.info.exec_id:
            raise tracked.error or SandboxFailed("the command did not start", field="cmd", fix="run it again")
        return tracked      # reachable by its exec id since it started (ExecTable), unless let go of

    async def exec_start(self, sandbox_id: str, req: ExecRequest) -> ExecInfo:
        """Start a command detached: returns its exec id at once; follow it with exec_follow,
        feed it with exec_stdin, signal it, or wait for its result with attach."""
        tracked = await self._start_tracked(sandbox_id, req, detached=True)
        return tracked.info.model_copy()

    def _exec_chan(self, sandbox_id: str, exec_id: str) -> int:
        try:
            chan = int(exec_id)
        except ValueError:
            raise InvalidArgument(f"bad exec id {exec_id!r}", field="exec_id", fix="use the exec_id from run/stream") from None
        if not 0 < chan < INTERNAL_CHAN_BASE:    # never the chan of an exec (0, negative, internal)
            raise NotFound(f"no exec {exec_id} in sandbox {sandbox_id}", field="exec_id",
                           fix="use the exec_id from run/stream")
        return chan

    async def _live_resumed(self, sandbox_id: str) -> LiveSandbox:
        """A running sandbox; a parked one is resumed first (callers never see `suspended`)."""
        if self._record(sandbox_id).state == SandboxState.suspended:
            await self.resume(sandbox_id)
        return self._running(sandbox_id)

    async def exec_follow(self, sandbox_id: str, exec_id: str) -> AsyncIterator[ExecEvent]:
        """start, all output of the exec from its beginning, then live, then exit. Several
        followers at once for execs the edge tracks (start_exec, idempotency key); others (after
        an edge restart, or a plain exec whose stream was lost) are attached at the agent, which
        replays what it retained."""
        chan = self._exec_chan(sandbox_id, exec_id)
        live = await self._live_resumed(sandbox_id)
        tracked = live.commands.tracked.get(exec_id)
        if tracked is not None:
            async for ev in tracked.follow():
                yield ev
            return
        async with self._use(sandbox_id) as (_, agent):
            yield ExecEvent(type="start", exec_id=exec_id)
            try:
                async for ev in exec_events(exec_id, agent.attach(chan), time.monotonic()):
                    if ev.type == "exit":
                        await agent.release(chan)
                    yield ev
            except AgentError as e:
                raise map_agent_error(e, "exec_id") from e
            except ValueError as e:   # the agent connection follows this chan already (AgentClient._register)
                raise Conflict(f"exec {chan} is being followed already, by another attach or the stream that "
                               "started it", field="exec_id",
                               fix="wait for that request to return the result, then attach again") from e

    async def attach(self, sandbox_id: str, exec_id: str) -> ExecResult:
        """Result of an earlier exec (waits for it; also after the client or the edge restarted)."""
        async for ev in self.exec_follow(sandbox_id, exec_id):
            if ev.type == "exit":
                if ev.result is None:
                    raise SandboxFailed(f"exec {exec_id} ended without a result: {ev.data}", field="exec_id",
                                        fix="run the command again")
                return ev.result
        raise SandboxFailed("attach ended without an exit status")

    def _known_exec(self, live: LiveSandbox, exec_id: str) -> ExecInfo | None:
        tracked = live.commands.tracked.get(exec_id)
        return tracked.info if tracked is not None else live.commands.running.get(exec_id)

    async def _check_running_exec(self, live: LiveSandbox, agent: AgentClient, chan: int) -> ExecInfo | None:
        info = self._known_exec(live, str(chan))
        if info is not None and not info.running:
            raise Conflict(f"exec {chan} has ended", field="exec_id", fix="start a new command")
        if info is None and chan not in {c for c, done in await agent.list_execs() if not done}:
            raise NotFound(f"no running exec {chan} in sandbox {live.id}", field="exec_id",
                           fix="list running commands with list_execs")
        return info

    async def exec_stdin(self, sandbox_id: str, exec_id: str, data: bytes, close: bool = False) -> None:
        """Write to the stdin of a command started with keep_stdin; close=True closes it (EOF)
        after `data`."""
        chan = self._exec_chan(sandbox_id, exec_id)
        async with self._use(sandbox_id) as (live, agent):
            info = await self._check_running_exec(live, agent, chan)
            if info is not None and not info.stdin_open:
                raise Conflict(f"exec {chan}'s stdin is not open: it was started without keep_stdin, or closed",
                               field="exec_id", fix="start the command with keep_stdin=true to write to it later")
            if data:
                await agent.send_stdin(chan, data)
            if close:
                await agent.send_stdin(chan, b"")
                if info is not None:
                    info.stdin_open = False

    async def exec_signal(self, sandbox_id: str, exec_id: str, signal: int) -> None:
        """Send `signal` to a running command (its whole process group)."""
        if not 0 < signal <= 64:
            raise InvalidArgument(f"signal {signal} is not a signal number", field="signal", fix="use 1..64, e.g. 15")
        chan = self._exec_chan(sandbox_id, exec_id)
        async with self._use(sandbox_id) as (live, agent):
            await self._check_running_exec(live, agent, chan)
            await agent.signal(chan, signal)

    async def list_execs(self, sandbox_id: str) -> builtins.list[ExecInfo]:
        """The sandbox's running commands (the agent's list, with what the edge knows of each)."""
        async with self._use(sandbox_id) as (live, agent):
            running = sorted(c for c, done in await agent.list_execs() if not done and 0 < c < INTERNAL_CHAN_BASE)
            out = []
            for chan in running:
                info = self._known_exec(live, str(chan))
                out.append(info.model_copy() if info is not None else ExecInfo(exec_id=str(chan)))
            return out

    async def set_timeout(self, sandbox_id: str, timeout_s: float) -> SandboxInfo:
        """The sandbox ends `timeout_s` from now, busy or not (its absolute lifetime)."""
        rec = self._record(sandbox_id)
        if rec.state not in (SandboxState.running, SandboxState.suspended, SandboxState.creating):
            raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}", field="sandbox_id", fix="create a new sandbox")
        rec.expires_at = time.time() + timeout_s
        await asyncio.to_thread(self.records.set_expires_at, rec.id, rec.expires_at)
        self._schedule(rec)
        return rec.info(self.node_id)

    async def close_session(self, sandbox_id: str, name: str) -> None:
        async with self._use(sandbox_id) as (_, agent):
            await agent.close_session(name)

    # -- files -------------------------------------------------------------------------------
    async def read_file(self, sandbox_id: str, path: str, maxlen: int = 64 << 20) -> bytes:
        check_path(path)
        async with self._use(sandbox_id) as (live, agent):
            try:
                return await agent.read_file(path, uid=live.rec.uid, gid=live.rec.gid, maxlen=maxlen)
            except AgentError as e:
                raise map_agent_error(e, "path") from e

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644,
                         mkdirs: bool = True) -> None:
        check_path(path)
        async with self._use(sandbox_id) as (live, agent):
            try:
                await agent.write_file(path, data, uid=live.rec.uid, gid=live.rec.gid, mode=mode, mkdirs=mkdirs)
            except AgentError as e:
                raise map_agent_error(e, "path") from e

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        check_path(path)
        async with self._use(sandbox_id) as (live, agent):
            try:
                entries: builtins.list[DirEntry] = await agent.list_dir(path, uid=live.rec.uid, gid=live.rec.gid)
            except AgentError as e:
                raise map_agent_error(e, "path") from e
        return [FileEntry(name=e.name, type=e.kind, size=e.size, mode=e.mode, mtime=e.mtime) for e in entries]

    async def remove_file(self, sandbox_id: str, path: str) -> None:
        check_path(path)
        async with self._use(sandbox_id) as (live, agent):
            try:
                await agent.remove(path, uid=live.rec.uid, gid=live.rec.gid)
            except AgentError as e:
                raise map_agent_error(e, "path") from e

    async def watch_dir(self, sandbox_id: str, path: str, recursive: bool = False,
                        user: str | None = None) -> AsyncIterator[FsEvent]:
        """Changes below directory `path` as they happen: first `start` once the agent watches it,
        then one event per change, until the caller stops (or the directory goes: NotFound). As
        the sandbox's user (or `user`); the sandbox counts as busy meanwhile."""
        check_path(path)
        async with self._use(sandbox_id) as (live, agent):
            project = live.rec.project
            if self._watches[project] >= MAX_WATCHES_PER_PROJECT:     # the agent caps each sandbox
                raise CapacityExceeded(f"project {project} already has {MAX_WATCHES_PER_PROJECT} open directory "
                                       "watches on this node", field="path", fix="stop some of its watches first")
            uid, gid = resolve_user(user) if user else (live.rec.uid, live.rec.gid)
            try:
                changes = await agent.watch(path, uid=uid, gid=gid, recursive=recursive)
            except AgentError as e:
                raise watch_error(e) from e
            self._watches[project] += 1
            try:
                yield FsEvent(type="start")
                async for batch in changes:     # an `overflow` (a reader too slow) ends it
                    for c in batch:
                        yield FsEvent(type=c.kind, name=c.name, is_dir=c.is_dir)
            except AgentError as e:
                raise watch_error(e) from e
            finally:
                self._watches[project] -= 1
                if self._watches[project] <= 0:
                    del self._watches[project]
                await changes.aclose()

    # -- port ingress ------------------------------------------------------------------------
    @asynccontextmanager
    async def port_connection(self, sandbox_id: str, port: int
                              ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        """A TCP connection to `port` inside the sandbox, for the apiserver's HTTP/WebSocket
        ingress. The sandbox counts as busy (never idle-reaped) while it is open; a parked one
        is resumed first. Closed on exit."""
        if not 0 < port < 65536:
            raise InvalidArgument(f"port {port} is not a TCP port", field="port", fix="use 1..65535")
        live = await self._live_resumed(sandbox_id)
        ingress = self._capability(live.rec, PortIngress, "reach its ports")
        with self._busy(live.rec):
            try:
                reader, writer = await ingress.open_port(sandbox_id, port)
            except ConnectionRefusedError:
                raise Unavailable(f"nothing listens on port {port} in sandbox {sandbox_id}", field="port",
                                  fix="start the server inside the sandbox (listening on 127.0.0.1 or 0.0.0.0) "
                                      "and retry") from None
            except FileNotFoundError:
                await self._check_alive(live, ConnectionError("sandbox gone"))
                raise
            try:
                yield reader, writer
            finally:
                writer.close()
                try:
                    await writer.wait_closed()
                except OSError:
                    pass

    # -- reaping -----------------------------------------------------------------------------
    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            try:
                await self.reap_once()
                self._reclaimer.tick()          # starts idle reclaims in the background
                await self._poll_disk()
                await self._check_liveness()
            except Exception:  # the reaper must outlive any single bad sandbox
                log.exception("reaper iteration failed")

    def _running_of(self, pred: Any) -> builtins.list[LiveSandbox]:
        return [x for x in self._live.values() if x.rec.state == SandboxState.running and pred(x.backend)]

    async def _poll_disk(self) -> None:
        """Fallback disk quota (backends whose kernel side cannot enforce disk_mb here): every
        DISK_POLL_S, measure each running sandbox's writable layer and fail the ones beyond
        disk_mb, saying so in their error."""
        if time.monotonic() < self._disk_next:
            return
        self._disk_next = time.monotonic() + DISK_POLL_S
        for live in self._running_of(lambda b: not b.disk_enforced):
            limit = live.rec.args.disk_mb << 20
            used = await asyncio.to_thread(live.backend.disk_usage, live.id)
            if used > limit and live.rec.state == SandboxState.running:
                await self._fail(live, f"disk quota exceeded: the writable layer holds {used >> 20} MiB, "
                                       f"more than disk_mb={limit >> 20}")

    async def _check_liveness(self) -> None:
        """Sandboxes of LivenessWatched backends whose runtime has exited are marked failed at
        once, with the reason from what they left; their agents are pinged now and then."""
        watched = self._running_of(lambda b: isinstance(b, LivenessWatched))
        for live in watched:
            if not await live.backend.is_running(live.id) and live.rec.state == SandboxState.running:
                await self._fail(live, live.backend.end_reason(live.id, None))
        due = []
        for b in {id(x.backend): x.backend for x in watched}.values():
            assert isinstance(b, LivenessWatched)
            if time.monotonic() >= self._next_ping.get(id(b), 0.0):
                self._next_ping[id(b)] = time.monotonic() + b.ping_interval_s
                due.append(b)
        # A guest that stopped scheduling (hung kernel, stuck vCPU, a reboot that spins)
        # keeps its runtime alive: only its agent's silence tells. Busy ones too: a request in
        # flight to a dead guest would otherwise wait forever; failing the sandbox ends it.
        await asyncio.gather(*(self._ping(x) for x in watched
                               if x.backend in due and x.rec.state == SandboxState.running))

    async def _ping(self, live: LiveSandbox) -> None:
        b = live.backend
        assert isinstance(b, LivenessWatched)
        try:
            agent = await asyncio.wait_for(live.connect(), b.ping_timeout_s)
            await asyncio.wait_for(agent.ping(), b.ping_timeout_s)
            live.ping_misses = 0
        except (OSError, ConnectionError, asyncio.TimeoutError, AgentError):
            # the connection stays: requests in flight keep it, and a late PONG goes to its own
            # (abandoned) chan and is dropped; a dead connection is replaced by the next connect()
            live.ping_misses += 1
            if live.ping_misses >= b.ping_misses and live.rec.state == SandboxState.running:
                await self._fail(live, f"the guest stopped answering (hung): no reply to {live.ping_misses} "
                                       f"pings {b.ping_interval_s:.0f}s apart")

    def _schedule(self, rec: SandboxRecord) -> None:
        """Tell the reaper when to look at this sandbox next: the earliest of its idle TTL, idle
        parking and absolute lifetime (activity moves them later; the reaper re-reads them)."""
        if rec.state not in (SandboxState.running, SandboxState.suspended):
            return
        self._reclaimer.watch(rec)
        when = rec.last_active_at + rec.ttl_idle_s
        if rec.expires_at is not None:
            when = min(when, rec.expires_at)
        park_after = _park_after(rec)
        if park_after and rec.state == SandboxState.running:
            when = min(when, rec.last_active_at + park_after)
        self._deadlines.push(rec.id, when)     # in the past (busy, retrying): the next tick

    async def reap_once(self) -> builtins.list[str]:
        """Stop sandboxes idle past their TTL or past their lifetime, park idle ones that ask for
        it. Looks only at sandboxes whose deadline has come (Deadlines), never at all of them."""
        self._flush_activity()
        now = time.time()
        reaped: builtins.list[str] = []
        for sid in self._deadlines.due(now):
            live = self._live.get(sid)
            if live is None:
                continue
            r = live.rec
            if r.state not in (SandboxState.running, SandboxState.suspended):
                continue
            if r.in_flight == 0 and now - r.last_active_at > r.ttl_idle_s:
                await self.stop(r.id, reason=f"idle for more than ttl_idle_s={r.ttl_idle_s}s")
                reaped.append(r.id)
                continue
            if r.expires_at is not None and now >= r.expires_at:   # busy or not
                await self.stop(r.id, reason="its lifetime ended (lifetime_s / set_timeout)")
                reaped.append(r.id)
                continue
            park_after = _park_after(r)
            if (park_after and r.state == SandboxState.running and r.in_flight == 0
                    and now - r.last_active_at > park_after):
                try:
                    await self.suspend(r.id)
                except DsecError as e:   # it keeps running; the next pass retries
                    log.warning("could not park idle sandbox", extra={"sandbox": r.id, "error": e.message})
            self._schedule(r)          # busy, parked, or used since: look again later
        if time.monotonic() >= self._purge_next:
            self._purge_next = time.monotonic() + PURGE_EVERY_S
            self.records.purge_ended(now - self.settings.keep_ended_s)
            for b in self._distinct_backends():
                b.purge(now - self.settings.keep_ended_s)
        return reaped
