"""The edge: one per node. Admission, storage, runtime, agent channel, TTL reaping, recovery.

The apiserver talks to an edge only through the async methods of this class (in-process in
the embedded deployment; through a Ray actor or HTTP in a multi-node one), so those methods
take and return the shared wire models only; the verbs the apiserver may call are declared once,
in apiserver/context.py's EdgeHandle (the cluster wire is derived from it).

Edge is a thin front over parts split by concern, each a class over the shared state of
core.EdgeCore: lifecycle.py (create, recover, stop), warm.py (warm-pool hooks), parking.py
(suspend/resume, snapshots), verbs.py (capability verbs), channel.py (the agent channel),
execs.py, files.py, ports.py, reaping.py. Here: the state's set-up, start/close and status.

The edge knows backends only through `dsec.backends.base`: the core every backend has, and
capability interfaces for verbs only some have, checked in `_capability` (one place, one
error). Each live sandbox is one `LiveSandbox` (live.py), freed in one place (`_teardown`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence

from dsec.backends.base import Backend
from dsec.config import Paths
from dsec.edge.admission import Admission
from dsec.edge.deadlines import Deadlines
from dsec.edge.live import LiveSandbox
from dsec.edge.load import NodeLoad
from dsec.edge.admit_wait import Claims
from dsec.edge.reclaim import Reclaimer
from dsec.edge.warm_auto import AutoPools
from dsec.edge.warm_pool import WarmPools, parse_targets
from dsec.edge.records import EdgeRecords
from dsec.edge.event_log import EventLog
from dsec.images.service import ImageService
from dsec.images.stacks import Stacks
from dsec.placement.locality import CacheSummary
from dsec.settings import Settings
from dsec.types import EdgeEvents, NodeStatus, SandboxInfo
from dsec.edge.core import MAX_WATCHES_PER_PROJECT, WARM_CPU_CORES, WARM_MEMORY_MB, EdgeSettings, log
from dsec.edge.lifecycle import Lifecycle
from dsec.edge.warm import WarmHooks
from dsec.edge.parking import ParkingVerbs
from dsec.edge.verbs import CapabilityVerbs
from dsec.edge.channel import AgentChannel
from dsec.edge.execs import Execs
from dsec.edge.files import Files
from dsec.edge.ports import Ports
from dsec.edge.reaping import Reaping
from dsec.edge.usage import UsageVerbs
from dsec.edge.volumes import VolumeVerbs
from dsec.edge.usage_book import UsageBook
from dsec import metrics

__all__ = ["Edge", "EdgeSettings", "MAX_WATCHES_PER_PROJECT", "PARTS"]

PARTS = ("core", "lifecycle", "warm", "parking", "verbs", "channel", "execs", "files", "ports", "reaping", "usage", "volumes")   # the modules Edge is made of


class Edge(Lifecycle, WarmHooks, ParkingVerbs, CapabilityVerbs, AgentChannel, Execs, Files, Ports, Reaping, UsageVerbs,
           VolumeVerbs):
    def __init__(self, paths: Paths, images: ImageService, backends: Sequence[Backend],
                 settings: EdgeSettings = EdgeSettings(), admission: Admission | None = None,
                 unavailable: Mapping[str, tuple[str, str | None]] | None = None, conf: Settings | None = None):
        self.paths = paths
        self.conf = conf or Settings()     # the composition root's (defaults for an edge built by hand)
        self.images = images
        self.stacks = Stacks(images)
        self._backends: dict[str, Backend] = {kind: b for b in backends for kind in b.kinds}
        self._unavailable = dict(unavailable or {})   # backend kind -> (why this node lacks it, fix)
        self.settings = settings
        self.node_id = settings.node_id
        self.admission = admission or Admission.for_this_host(paths.home, conf=self.conf)   # + its disks' reserves
        self.records = EdgeRecords(paths.edge_db)
        self.observed = self.conf.observability.enabled    # DSEC_OBSERVABILITY: events, sampling, metrics
        metrics.set_enabled(self.observed)
        self.events = EventLog(paths.edge_db, self.node_id, enabled=self.observed)
        self._live: dict[str, LiveSandbox] = {}
        self._dirty: set[str] = set()          # activity and output counters to flush
        self._create_slots = asyncio.Semaphore(settings.max_parallel_creates or self.conf.edge.create_parallel)
        self._reaper: asyncio.Task[None] | None = None
        self._exit_tasks: set[asyncio.Task[None]] = set()   # failing sandboxes whose runtime exited
        self._next_ping: dict[int, float] = {}   # per LivenessWatched backend (by id())
        self._disk_next = 0.0
        self._creating_keys: dict[tuple[str, str], asyncio.Task[SandboxInfo]] = {}   # idempotent creates under way
        self._export_lock = asyncio.Lock()     # snapshot exports (parking.py)
        self._load = NodeLoad()                # committed CPU/memory of the live sandboxes, as running totals
        self._cached_images = CacheSummary()   # images this node holds: placement prefers it for them (D34)
        self._deadlines = Deadlines()          # when the reaper looks at each sandbox next (O(due) ticks)
        self._purge_next = 0.0                 # monotonic: ended records are purged once a minute
        self._watches: Counter[str] = Counter()   # open directory watches per project
        self._reclaimer = Reclaimer.from_settings(self._live, self.admission.probe, self.conf.edge)   # idle memory out (reclaim.py)
        self._claims = Claims()      # paces admissions near the memory floor (admit_wait.py)
        # warm pools of idle containers per environment, claimed by creates (warm_pool.py)
        # and automatic ones, of the burst shapes the node sees (warm_auto.py, D99)
        self._pools = WarmPools(parse_targets(self.conf.edge.warm_pool), self._warm_start, self._warm_key_of,
                                self._warm_drop, self.conf.edge.warm_pool_parallel,
                                auto=AutoPools(self.conf.edge.warm_pool_auto, self.conf.edge.warm_pool_auto_idle_s),
                                room=self._auto_room)
        self._usage = UsageBook(self.conf.edge.usage_watched_s, self.conf.edge.usage_idle_s)
        self._sampler: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._recover()
        self._reaper = asyncio.create_task(self._reap_loop(), name="edge-reaper")
        self._pools.start()     # after recovery: the pool containers of an edge that died are gone
        if self.observed:       # off: a sandbox's usage is read only when asked for (usage.py)
            self._sampler = asyncio.create_task(self._sample_loop(), name="edge-usage-sampler")
        metrics.add_edge(self)     # its gauges in the process's /metrics
        log.info("edge started", extra={"node": self.node_id, "sandboxes": len(self._live)})

    async def close(self) -> None:
        """Stop serving. Sandboxes keep running; a restarted edge picks them up again."""
        metrics.remove_edge(self)
        for task in (self._reaper, self._sampler):
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
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
        self.events.close()
        if not self._live:
            # Nothing uses the node's layer mounts: leave no mount behind (`dsec down`). With
            # live sandboxes they stay, so a restarted edge shares their page cache again.
            await self.stacks.unmount_all()
            for b in self._distinct_backends():
                await b.release_node()

    async def events_since(self, after: int, limit: int = 1000) -> EdgeEvents:
        """Lifecycle events after seq `after` (the apiserver's pull, apiserver/events.py)."""
        return await asyncio.to_thread(self.events.since, after, limit)

    async def metrics_text(self, project: str | None = None) -> str:
        """This process's Prometheus metrics (text format); with `project`, only its series."""
        return metrics.exposition(project)

    async def status(self) -> NodeStatus:
        """The node as placement sees it: the automatic warm pools' sandboxes are left out,
        since they give way to any create the node is asked for (warm.py `_admit_tenant`)."""
        st = await self._node_status()
        n = self._pools.auto_held()
        if n:
            st.sandboxes -= n
            st.committed_cpu_cores = max(0.0, st.committed_cpu_cores - n * WARM_CPU_CORES)
            st.committed_memory_mb = max(0, st.committed_memory_mb - n * WARM_MEMORY_MB)
        return st

    async def _node_status(self) -> NodeStatus:
        """Everything the node holds, its own warm pools included: what admission counts."""
        # parked sandboxes hold no CPU or memory: they do not count against admission
        # (running totals, NodeLoad: a status is O(1) however many sandboxes the node holds)
        problem = self.admission.host_problem()
        if problem is not None and self._reclaimer.squeeze():
            problem = None   # below the reserve, but idle memory is being reclaimed: creates wait for it (D95)
        return NodeStatus(node_id=self.node_id, healthy=problem is None, reason=problem,
                          backends=self.backends, capacity=self.admission.capacity,
                          committed_cpu_cores=self._load.cpu_cores, committed_memory_mb=self._load.memory_mb,
                          sandboxes=self._load.sandboxes, pressure=self.admission.pressure(),
                          cached_images=self._cached_images.keys())
