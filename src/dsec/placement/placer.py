"""Power-of-k-choices placement over the watcher's (slightly stale) view of the nodes.

The watcher polls every second or so, so during a burst many placements see the same
snapshot. Without correction every one of them would pick the same "least loaded" node; the
placer therefore adds its own recent placements (pending reservations) to each node's load
until the watcher's counts show them, or until they expire. The edge's admission check stays
the final word: a stale view costs a retry elsewhere, never an overcommit.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dsec.types import CapacityExceeded, InvalidArgument, NodeStatus

log = logging.getLogger("dsec.placement")

_EPS = 1e-9
PRESSURE_STEERS = 0.5   # a node's pressure counts in its load from half its admission limit on


@dataclass
class _Reservation:
    cpu_cores: float
    memory_mb: int
    # Sandbox count the node should report once this placement (and the earlier pending ones)
    # have landed; when the watcher reports at least this many, the reservation is redundant.
    expected_sandboxes: int
    expires_at: float


class Placer:
    """Choose nodes for sandboxes. Thread-safe; keeps only short-lived in-memory state."""

    def __init__(self, k: int = 2, pending_ttl_s: float = 2.0, rng: random.Random | None = None,
                 *, clock: Callable[[], float] = time.monotonic):
        if k < 1:
            raise InvalidArgument(f"k must be >= 1, got {k}", field="k", fix="use k=2")
        self.k = k
        self.pending_ttl_s = pending_ttl_s
        self._rng = rng or random.Random()
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, list[_Reservation]] = {}

    # ------------------------------------------------------------------ public

    def choose(self, nodes: list[NodeStatus], backend: str, cpu_cores: float, memory_mb: int,
               exclude: Iterable[str] = frozenset()) -> str:
        """Return the node id for a new sandbox and reserve its resources there.

        `nodes` is the latest watcher view (also fed to observe()). `exclude` lists nodes
        that already refused this request. Call release() if the creation then fails.
        """
        if cpu_cores < 0 or memory_mb < 0:
            raise InvalidArgument("cpu_cores and memory_mb must be >= 0",
                                  field="cpu_cores" if cpu_cores < 0 else "memory_mb",
                                  fix="pass a positive request")
        excluded = set(exclude)
        with self._lock:
            now = self._clock()
            self._observe_locked(nodes, now)
            eligible = [n for n in nodes
                        if n.healthy and backend in n.backends and n.node_id not in excluded]
            fitting = [n for n in eligible if self._fits(n, cpu_cores, memory_mb)]
            if not fitting:
                raise self._no_room(nodes, eligible, excluded, backend, cpu_cores, memory_mb)
            sample = self._rng.sample(fitting, min(self.k, len(fitting)))
            best = min(sample, key=lambda n: self._load_after(n, cpu_cores, memory_mb))
            queue = self._pending.setdefault(best.node_id, [])
            queue.append(_Reservation(cpu_cores, memory_mb,
                                      expected_sandboxes=best.sandboxes + len(queue) + 1,
                                      expires_at=now + self.pending_ttl_s))
        log.debug("placed %s cpu=%s mem=%s on %s (sampled %s)", backend, cpu_cores, memory_mb,
                  best.node_id, [n.node_id for n in sample])
        return best.node_id

    def observe(self, nodes: list[NodeStatus]) -> None:
        """Drop reservations that the watcher's counts now include, and expired ones."""
        with self._lock:
            self._observe_locked(nodes, self._clock())

    def release(self, node_id: str, cpu_cores: float, memory_mb: int) -> bool:
        """Drop one pending reservation (creation failed). False if none matched (already
        caught up or expired), which is harmless."""
        with self._lock:
            queue = self._pending.get(node_id, [])
            for i in range(len(queue) - 1, -1, -1):
                r = queue[i]
                if abs(r.cpu_cores - cpu_cores) < _EPS and r.memory_mb == memory_mb:
                    del queue[i]
                    for later in queue[i:]:   # one sandbox fewer will land before them
                        later.expected_sandboxes -= 1
                    if not queue:
                        del self._pending[node_id]
                    return True
        return False

    def landed(self, node_id: str, cpu_cores: float, memory_mb: int, visible_within_s: float = 1.0) -> bool:
        """The creation succeeded: the node's own count will show it within one watcher poll,
        so keep the reservation at most that long. Without this, create-and-stop churn (the
        count never reaches `expected_sandboxes`) pins every reservation for its full TTL."""
        with self._lock:
            deadline = self._clock() + visible_within_s
            for r in reversed(self._pending.get(node_id, [])):
                if abs(r.cpu_cores - cpu_cores) < _EPS and r.memory_mb == memory_mb and r.expires_at > deadline:
                    r.expires_at = deadline
                    return True
        return False

    def pending(self, node_id: str) -> tuple[float, int, int]:
        """(cpu_cores, memory_mb, sandboxes) reserved on node_id but not yet observed."""
        with self._lock:
            self._expire_locked(self._clock())
            return self._pending_sum(node_id)

    # ------------------------------------------------------------------ internals

    def _expire_locked(self, now: float) -> None:
        for node_id in list(self._pending):
            live = [r for r in self._pending[node_id] if r.expires_at > now]
            if live:
                self._pending[node_id] = live
            else:
                del self._pending[node_id]

    def _observe_locked(self, nodes: list[NodeStatus], now: float) -> None:
        self._expire_locked(now)
        for n in nodes:
            queue = self._pending.get(n.node_id)
            if queue:
                live = [r for r in queue if r.expected_sandboxes > n.sandboxes]
                if live:
                    self._pending[n.node_id] = live
                else:
                    del self._pending[n.node_id]

    def _pending_sum(self, node_id: str) -> tuple[float, int, int]:
        queue = self._pending.get(node_id, [])
        return (sum(r.cpu_cores for r in queue), sum(r.memory_mb for r in queue), len(queue))

    def _usage(self, n: NodeStatus) -> tuple[float, int, int]:
        cpu, mem, count = self._pending_sum(n.node_id)
        return n.committed_cpu_cores + cpu, n.committed_memory_mb + mem, n.sandboxes + count

    def _fits(self, n: NodeStatus, cpu_cores: float, memory_mb: int) -> bool:
        cpu, mem, count = self._usage(n)
        c = n.capacity
        return (cpu + cpu_cores <= c.cpu_cores + _EPS and mem + memory_mb <= c.memory_mb
                and count + 1 <= c.max_sandboxes)

    def _load_after(self, n: NodeStatus, cpu_cores: float, memory_mb: int) -> float:
        # Load the node would have with this sandbox: on mixed node sizes this keeps a big
        # request off a small node that merely looks idle. Measured pressure (PSI relative to the
        # edge's admission limit) counts once it is half way to a refusal: the ceilings on limits
        # are far above real use, so there it is what tells two samples apart. Below that it is
        # ignored: it is stale for seconds, and the pending reservations that spread a burst
        # only move the other terms.
        cpu, mem, count = self._usage(n)
        c = n.capacity
        return max((cpu + cpu_cores) / max(c.cpu_cores, _EPS),
                   (mem + memory_mb) / max(c.memory_mb, 1),
                   (count + 1) / max(c.max_sandboxes, 1),
                   n.pressure if n.pressure >= PRESSURE_STEERS else 0.0)

    def _no_room(self, nodes: list[NodeStatus], eligible: list[NodeStatus], excluded: set[str],
                 backend: str, cpu_cores: float, memory_mb: int) -> CapacityExceeded:
        ask = f"cpu_cores={cpu_cores:g} memory_mb={memory_mb} backend={backend!r}"
        if not eligible:
            healthy = [n for n in nodes if n.healthy]
            offering = [n for n in healthy if backend in n.backends]
            if not nodes:
                why, field = "no nodes are registered", None
            elif not healthy:
                why, field = f"none of the {len(nodes)} nodes is healthy", None
            elif not offering:
                why, field = (f"no healthy node offers backend {backend!r} "
                              f"({len(healthy)} healthy nodes)"), "backend"
            else:
                why, field = f"all {len(offering)} nodes offering it already refused ({len(excluded)} excluded)", None
            return CapacityExceeded(f"cannot place {ask}: {why}", field=field,
                                    fix="retry later, or pick a backend that a healthy node offers")
        # Per resource: how many nodes would have room on that dimension alone, and the most
        # headroom anywhere. The resource that fewest nodes can satisfy is the tightest.
        free = [(n, *self._usage(n)) for n in eligible]
        dims = {
            "memory_mb": (sum(1 for n, _, m, _ in free if m + memory_mb <= n.capacity.memory_mb),
                          max(n.capacity.memory_mb - m for n, _, m, _ in free), "MiB"),
            "cpu_cores": (sum(1 for n, c, _, _ in free if c + cpu_cores <= n.capacity.cpu_cores + _EPS),
                          max(n.capacity.cpu_cores - c for n, c, _, _ in free), "cores"),
            "sandboxes": (sum(1 for n, _, _, s in free if s + 1 <= n.capacity.max_sandboxes),
                          max(n.capacity.max_sandboxes - s for n, _, _, s in free), "sandbox slots"),
        }
        tightest = min(dims, key=lambda d: dims[d][0])
        fits, most, unit = dims[tightest]
        most_txt = f"{most:g}" if isinstance(most, float) else str(most)
        return CapacityExceeded(
            f"cannot place {ask}: {tightest} is the tightest resource; "
            f"{fits} of {len(eligible)} eligible nodes have room for it, the most free on any "
            f"node is {most_txt} {unit}",
            field=None if tightest == "sandboxes" else tightest,
            fix="request less, stop idle sandboxes, or retry when capacity frees up")
