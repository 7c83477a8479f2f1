"""Power-of-k-choices placement over the watcher's (slightly stale) view of the nodes.

The watcher polls every second or so, so during a burst many placements see the same
snapshot. Without correction every one of them would pick the same "least loaded" node; the
placer therefore adds its own recent placements (pending reservations) to each node's load
until the watcher's counts show them, or until they expire. The edge's admission check stays
the final word: a stale view costs a retry elsewhere, never an overcommit.

Image locality (D34): a request may name its image; nodes whose status lists it among their
cached images get `locality_bonus` off their load when the sampled candidates are compared, and
k of them are sampled besides the k uniform ones. A node that holds the image wins unless it is
more than the bonus (in load fraction) fuller than the best other candidate, so a popular image
never piles onto the few nodes that have it.

Cost per decision is O(k) in the number of nodes and reservations, not O(n): a new watcher
snapshot (recognised by the identity of its NodeStatus objects, which the watcher replaces and
never mutates) is folded in once; reservations expire from a heap; pending totals are running
sums; candidates are drawn by rejection sampling from the view (exactly uniform among the nodes
that qualify), with a full scan only when most nodes do not qualify.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import operator
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from dsec.placement.locality import image_key
from dsec.types import CapacityExceeded, InvalidArgument, NodeStatus

log = logging.getLogger("dsec.placement")

_EPS = 1e-9
PRESSURE_STEERS = 0.5   # a node's pressure counts in its load from half its admission limit on
LOCALITY_BONUS = 0.02   # load fraction a cached image is worth (chosen with `dsec bench cluster-sim`, D34)
_DRAWS_PER_PICK = 4     # random draws per wanted candidate before falling back to a full scan


@dataclass(eq=False)
class _Reservation:
    node_id: str
    cpu_milli: int      # millicores: running sums stay exact
    memory_mb: int
    # Sandbox count the node should report once this placement (and the earlier pending ones)
    # have landed; when the watcher reports at least this many, the reservation is redundant.
    expected_sandboxes: int
    expires_at: float
    live: bool = True


def _milli(cpu_cores: float) -> int:
    return round(cpu_cores * 1000)


class Placer:
    """Choose nodes for sandboxes. Thread-safe; keeps only short-lived in-memory state."""

    def __init__(self, k: int = 2, pending_ttl_s: float = 2.0, rng: random.Random | None = None,
                 *, clock: Callable[[], float] = time.monotonic, locality_bonus: float = LOCALITY_BONUS,
                 locality_k: int | None = None):
        if k < 1:
            raise InvalidArgument(f"k must be >= 1, got {k}", field="k", fix="use k=2")
        if locality_bonus < 0:
            raise InvalidArgument(f"locality_bonus must be >= 0, got {locality_bonus}", field="locality_bonus",
                                  fix=f"use {LOCALITY_BONUS} (0 turns image locality off)")
        if locality_k is not None and locality_k < 0:
            raise InvalidArgument(f"locality_k must be >= 0, got {locality_k}", field="locality_k",
                                  fix="leave it unset (= k)")
        self.k = k
        self.pending_ttl_s = pending_ttl_s
        self.locality_bonus = locality_bonus
        self.locality_k = k if locality_k is None else locality_k   # extra candidates among nodes holding the image
        self._rng = rng or random.Random()
        self._clock = clock
        self._lock = threading.Lock()
        # live reservations per node (dead ones are dropped lazily) and their running totals
        self._pending: dict[str, list[_Reservation]] = {}
        self._sums: dict[str, list[int]] = {}          # node -> [cpu_milli, memory_mb, count]
        self._expiry: list[tuple[float, int, _Reservation]] = []
        self._seq = itertools.count()
        self._view: list[NodeStatus] = []              # the snapshot last folded in (a copy)
        self._local: dict[str, list[int]] | None = None   # image key -> view indices caching it

    # ------------------------------------------------------------------ public

    def choose(self, nodes: Sequence[NodeStatus], backend: str, cpu_cores: float, memory_mb: int,
               exclude: Iterable[str] = frozenset(), image: str | None = None) -> str:
        """Return the node id for a new sandbox and reserve its resources there.

        `nodes` is the latest watcher view (also fed to observe()). `exclude` lists nodes
        that already refused this request. `image` (its digest) prefers nodes that hold it.
        Call release() if the creation then fails.
        """
        if cpu_cores < 0 or memory_mb < 0:
            raise InvalidArgument("cpu_cores and memory_mb must be >= 0",
                                  field="cpu_cores" if cpu_cores < 0 else "memory_mb",
                                  fix="pass a positive request")
        excluded: set[str] | frozenset[str] = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
        cpu_milli = _milli(cpu_cores)
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            if not self._same_view(nodes):
                self._fold_view_locked(nodes)

            def load(n: NodeStatus) -> float | None:
                """The node's load with this sandbox; None if it cannot take it."""
                if not n.healthy or backend not in n.backends or n.node_id in excluded:
                    return None
                return self._load_if_fits(n, cpu_milli, memory_mb)

            sample = self._sample(nodes, None, load, self.k)
            key = image_key(image) if image and self.locality_bonus > 0 else None
            if key is not None:
                local = self._local_locked(key)
                if local and self.locality_k > 0:
                    seen = {n.node_id for _, n in sample}
                    sample += [c for c in self._sample(nodes, local, load, self.locality_k)
                               if c[1].node_id not in seen]
                bonus = self.locality_bonus
                sample = [(x - bonus if key in n.cached_images else x, n) for x, n in sample]
            if not sample:
                eligible = [n for n in nodes
                            if n.healthy and backend in n.backends and n.node_id not in excluded]
                raise self._no_room(list(nodes), eligible, set(excluded), backend, cpu_cores, memory_mb)
            best = min(sample, key=operator.itemgetter(0))[1]
            sums = self._sums.setdefault(best.node_id, [0, 0, 0])
            r = _Reservation(best.node_id, cpu_milli, memory_mb,
                             expected_sandboxes=best.sandboxes + sums[2] + 1,
                             expires_at=now + self.pending_ttl_s)
            self._pending.setdefault(best.node_id, []).append(r)
            sums[0] += cpu_milli
            sums[1] += memory_mb
            sums[2] += 1
            heapq.heappush(self._expiry, (r.expires_at, next(self._seq), r))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("placed %s cpu=%s mem=%s on %s (sampled %s)", backend, cpu_cores, memory_mb,
                      best.node_id, [(n.node_id, round(x, 4)) for x, n in sample])
        return best.node_id

    def observe(self, nodes: Sequence[NodeStatus]) -> None:
        """Drop reservations that the watcher's counts now include, and expired ones."""
        with self._lock:
            self._expire_locked(self._clock())
            self._fold_view_locked(nodes)

    def release(self, node_id: str, cpu_cores: float, memory_mb: int) -> bool:
        """Drop one pending reservation (creation failed). False if none matched (already
        caught up or expired), which is harmless."""
        cpu_milli = _milli(cpu_cores)
        with self._lock:
            queue = self._pending.get(node_id, [])
            for i in range(len(queue) - 1, -1, -1):
                r = queue[i]
                if r.live and r.cpu_milli == cpu_milli and r.memory_mb == memory_mb:
                    self._kill(r)
                    for later in queue[i + 1:]:   # one sandbox fewer will land before them
                        later.expected_sandboxes -= 1
                    self._compact(node_id)
                    return True
        return False

    def landed(self, node_id: str, cpu_cores: float, memory_mb: int, visible_within_s: float = 1.0) -> bool:
        """The creation succeeded: the node's own count will show it within one watcher poll,
        so keep the reservation at most that long. Without this, create-and-stop churn (the
        count never reaches `expected_sandboxes`) pins every reservation for its full TTL."""
        cpu_milli = _milli(cpu_cores)
        with self._lock:
            deadline = self._clock() + visible_within_s
            for r in reversed(self._pending.get(node_id, [])):
                if r.live and r.cpu_milli == cpu_milli and r.memory_mb == memory_mb and r.expires_at > deadline:
                    r.expires_at = deadline   # the later heap entry finds it gone or still live
                    heapq.heappush(self._expiry, (deadline, next(self._seq), r))
                    return True
        return False

    def pending(self, node_id: str) -> tuple[float, int, int]:
        """(cpu_cores, memory_mb, sandboxes) reserved on node_id but not yet observed."""
        with self._lock:
            self._expire_locked(self._clock())
            cpu, mem, count = self._sums.get(node_id, (0, 0, 0))
            return cpu / 1000, mem, count

    # ------------------------------------------------------------------ internals

    def _kill(self, r: _Reservation) -> None:
        if r.live:
            r.live = False
            sums = self._sums[r.node_id]
            sums[0] -= r.cpu_milli
            sums[1] -= r.memory_mb
            sums[2] -= 1

    def _compact(self, node_id: str) -> None:
        live = [r for r in self._pending.get(node_id, ()) if r.live]
        if live:
            self._pending[node_id] = live
        else:
            self._pending.pop(node_id, None)
            self._sums.pop(node_id, None)

    def _expire_locked(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            r = heapq.heappop(heap)[2]
            if r.live and r.expires_at <= now:
                self._kill(r)
                # dead entries stay in the node's list until they are half of it (amortised O(1))
                queue = self._pending.get(r.node_id)
                if queue is not None and len(queue) > 2 * self._sums[r.node_id][2] + 8:
                    self._compact(r.node_id)

    def _same_view(self, nodes: Sequence[NodeStatus]) -> bool:
        # List equality compares identity first: the same snapshot costs ~160 pointer compares.
        # An equal copy (new objects, same content) counts as the same, and is kept so that the
        # next call compares identities again.
        view = list(nodes)
        if view == self._view:
            self._view = view
            return True
        return False

    def _fold_view_locked(self, nodes: Sequence[NodeStatus]) -> None:
        """A new watcher snapshot: drop what its counts include; forget the locality index."""
        for n in nodes:
            queue = self._pending.get(n.node_id)
            if queue:
                for r in queue:
                    if r.expected_sandboxes <= n.sandboxes:
                        self._kill(r)
                self._compact(n.node_id)
        self._view = list(nodes)
        self._local = None

    def _local_locked(self, key: str) -> list[int]:
        """View indices of the nodes caching the image; the index is built once per snapshot,
        on the first request that names an image (one pass over the summaries)."""
        if self._local is None:
            index: dict[str, list[int]] = {}
            for i, n in enumerate(self._view):
                for k in n.cached_images:
                    index.setdefault(k, []).append(i)
            self._local = index
        return self._local.get(key, [])

    def _sample(self, nodes: Sequence[NodeStatus], among: list[int] | None,
                load: Callable[[NodeStatus], float | None], k: int) -> list[tuple[float, NodeStatus]]:
        """Up to k distinct (load, node), uniformly among the nodes (of `among`, else all) that
        can take the sandbox (load() not None).

        Rejection sampling: each draw is uniform over the nodes not yet looked at, and keeping
        the ones that pass is uniform over those that pass. After k x _DRAWS_PER_PICK draws
        (most nodes full or unhealthy) the rest are scanned instead."""
        m = len(among) if among is not None else len(nodes)
        out: list[tuple[float, NodeStatus]] = []
        seen: set[int] = set()
        rnd = self._rng.random
        for _ in range(min(k * _DRAWS_PER_PICK, m)):
            j = int(rnd() * m)
            if j in seen:
                continue
            seen.add(j)
            n = nodes[among[j] if among is not None else j]
            x = load(n)
            if x is not None:
                out.append((x, n))
                if len(out) == k:
                    return out
        if len(seen) < m:
            rest = []
            for j in range(m):
                if j not in seen:
                    n = nodes[among[j] if among is not None else j]
                    x = load(n)
                    if x is not None:
                        rest.append((x, n))
            out += self._rng.sample(rest, min(k - len(out), len(rest)))
        return out

    def _pending_sum(self, node_id: str) -> tuple[float, int, int]:
        cpu, mem, count = self._sums.get(node_id, (0, 0, 0))
        return cpu / 1000, mem, count

    def _usage(self, n: NodeStatus) -> tuple[float, int, int]:
        cpu, mem, count = self._pending_sum(n.node_id)
        return n.committed_cpu_cores + cpu, n.committed_memory_mb + mem, n.sandboxes + count

    def _load_if_fits(self, n: NodeStatus, cpu_milli: int, memory_mb: int) -> float | None:
        """Load the node would have with this sandbox (None: it has no room), counting our own
        pending placements. On mixed node sizes this keeps a big request off a small node that
        merely looks idle. Measured pressure (PSI relative to the edge's admission limit) counts
        once it is half way to a refusal: the ceilings on limits are far above real use, so there
        it is what tells two samples apart. Below that it is ignored: it is stale for seconds,
        and the pending reservations that spread a burst only move the other terms."""
        pend = self._sums.get(n.node_id)
        cpu = n.committed_cpu_cores + cpu_milli / 1000
        mem = n.committed_memory_mb + memory_mb
        count = n.sandboxes + 1
        if pend is not None:
            cpu += pend[0] / 1000
            mem += pend[1]
            count += pend[2]
        c = n.capacity
        if cpu > c.cpu_cores + _EPS or mem > c.memory_mb or count > c.max_sandboxes:
            return None
        return max(cpu / max(c.cpu_cores, _EPS), mem / max(c.memory_mb, 1), count / max(c.max_sandboxes, 1),
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
