"""Shared state of the edge and the lookups every part uses (backend by kind, capability
checks, records by id); the constants of the edge.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from dsec import metrics
from dsec.backends.base import Backend
from dsec.config import Paths
from dsec.edge.admission import Admission
from dsec.edge.deadlines import Deadlines
from dsec.edge.event_log import EventLog
from dsec.edge.live import LiveSandbox
from dsec.edge.load import NodeLoad
from dsec.edge.admit_wait import Claims
from dsec.edge.reclaim import Reclaimer
from dsec.edge.warm_pool import WarmPools
from dsec.edge.records import EdgeRecords, SandboxRecord
from dsec.images.service import ImageService
from dsec.images.stacks import Stacks
from dsec.placement.locality import CacheSummary
from dsec.settings import Settings
from dsec.types import Conflict, EventType, InvalidArgument, is_infrastructure, NotFound, SandboxInfo, SandboxState, Unavailable

if TYPE_CHECKING:
    from dsec.edge.usage_book import UsageBook

log = logging.getLogger("dsec.edge")

LIVE = (SandboxState.creating, SandboxState.running, SandboxState.suspended, SandboxState.stopping)
BULK_PARALLEL = 16        # parks/resumes of one bulk call at a time (each reclaims memory: I/O- and CPU-bound)
PURGE_EVERY_S = 60.0      # ended records and what they left are forgotten at most this often
MAX_WATCHES_PER_PROJECT = 256   # open directory watches of one project on this node (16 a sandbox: the agent's)
# Warm pool sandboxes while they wait (warm_pool.py): the node's own, counted by admission at
# this size; a claim gives them the claimer's limits.
WARM_PROJECT = "system"
WARM_LABEL = "dsec.warm-pool"
WARM_CPU_CORES = 1.0
WARM_MEMORY_MB = 256


def _park_after(rec: SandboxRecord) -> int | None:
    """Idle seconds after which the sandbox is parked (None: never)."""
    return rec.args.suspend_idle_s


Cap = TypeVar("Cap")


@dataclass(frozen=True)
class EdgeSettings:
    node_id: str = "local"
    reap_interval_s: float = 2.0
    keep_ended_s: float = 24 * 3600      # stopped/failed records stay visible this long
    max_parallel_creates: int | None = None   # None: DSEC_CREATE_PARALLEL
    services: tuple[str, ...] = ()       # backends served beside the edge on this node (e.g. "fncall")


class EdgeCore:
    """The state every part of the edge shares (set up by Edge.__init__), and the lookups
    they all use. Each part (lifecycle.py, parking.py, execs.py ...) is a class over it; Edge
    (edge.py) puts them together."""

    paths: Paths
    images: ImageService
    stacks: Stacks
    _backends: dict[str, Backend]
    _unavailable: dict[str, tuple[str, str | None]]
    settings: EdgeSettings
    conf: Settings               # the process's DSEC_* settings (dsec.settings)
    node_id: str
    admission: Admission
    records: EdgeRecords
    _live: dict[str, LiveSandbox]
    _dirty: set[str]
    _create_slots: asyncio.Semaphore
    _reaper: asyncio.Task[None] | None
    _exit_tasks: set[asyncio.Task[None]]
    _next_ping: dict[int, float]
    _disk_next: float
    _creating_keys: dict[tuple[str, str], asyncio.Task[SandboxInfo]]
    _export_lock: asyncio.Lock         # snapshot exports, one pack at a time (parking.py)
    _load: NodeLoad
    _cached_images: CacheSummary
    _deadlines: Deadlines
    _purge_next: float
    _watches: Counter[str]
    _reclaimer: Reclaimer
    _claims: Claims              # memory of creates admitted a moment ago (admit_wait.py)
    _pools: WarmPools
    _usage: "UsageBook"            # per-sandbox usage rings (usage.py)
    events: EventLog               # lifecycle events, pulled by the apiserver (event_log.py)
    observed: bool                 # DSEC_OBSERVABILITY: metrics, usage sampling, events on

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

    def _emit(self, type_: EventType, rec: SandboxRecord, *, reason: str | None = None,
              message: str | None = None, **details: Any) -> None:
        """A lifecycle event of `rec` (the apiserver pulls it: events, webhooks)."""
        self.events.append(type_, rec.id, rec.project, reason=reason, message=message, details=details)
        if type_ == EventType.ended and reason:
            metrics.ENDS.labels(rec.project, rec.backend, reason, str(is_infrastructure(reason)).lower()).inc()

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
                           field="sandbox_id", fix="create a new sandbox", reason=rec.end_reason)
        return live
