"""`dsec bench cluster-sim`: the real Placer and the real Watcher driven by simulated edges (D34).

What is real: `dsec.placement.Placer` (every decision, timed by wall clock), `dsec.watcher.Watcher`
(its poll_once() every `poll_s` of simulated time, so placements between polls see a stale view,
as in production), the edge's admission capacity check (`dsec.edge.admission.Admission`, which
refuses when a node is full; the caller then places elsewhere, up to the apiserver's
PLACEMENT_TRIES) and the edge's image summary (`dsec.placement.locality.CacheSummary`).

What is simulated: time (a virtual clock, which the placer reads), the nodes (capacity, their
committed load, an LRU cache of `cache_images` images), arrivals (Poisson at `rate`/s), requests
(sizes drawn from SIZES, images from a Zipf over `images`), lifetimes (exponential with mean
live/rate, so the live count stays near `live` by Little's law) and failures (every
`fail_every_s` one node dies, losing its sandboxes, and comes back empty `down_s` later; until the
next poll placement still sends it creations, which fail and are retried elsewhere).

The cluster starts balanced (each node filled in proportion to its capacity, the same for every
policy); each policy then runs the same arrival trace (same seed), so the numbers are side by side.
Imbalance is max/mean of the true committed load (NodeStatus.load: the tightest of CPU, memory and
count, relative to the node's ceiling) over the healthy nodes, sampled every `sample_s`.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import heapq
import random
import statistics
import time
from bisect import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from dsec.apiserver.control import PLACEMENT_TRIES
from dsec.edge.admission import Admission
from dsec.edge.pressure import HostProbe, Reading
from dsec.placement import Placer
from dsec.placement.placer import LOCALITY_BONUS
from dsec.placement.locality import CacheSummary
from dsec.types import CapacityExceeded, NodeCapacity, NodeStatus, Unavailable
from dsec.watcher import Watcher

BACKEND = "container"
# (cpu_cores, memory_mb, weight): agents ask for small sandboxes, a few for big ones
SIZES: tuple[tuple[float, int, float], ...] = ((0.5, 1024, 0.40), (1.0, 2048, 0.35), (2.0, 4096, 0.20),
                                               (4.0, 8192, 0.05))
# A full node's ceilings (admission's count default; CPU and memory ceilings set so that 380K
# sandboxes of SIZES on 160 nodes use ~85% of them: a poorly balanced node runs out and refuses);
# a fifth of the nodes are half size.
FULL = NodeCapacity(cpu_cores=3600.0, memory_mb=7_200_000, max_sandboxes=4000)
HALF = NodeCapacity(cpu_cores=1800.0, memory_mb=3_600_000, max_sandboxes=2000)


@dataclass(frozen=True)
class Policy:
    name: str
    k: int
    pending_ttl_s: float = 2.0
    locality_bonus: float | None = None    # None: the request's image is not passed at all
    locality_k: int | None = None           # None: k

    def placer(self, rng: random.Random, clock: Callable[[], float]) -> Placer:
        if self.locality_bonus is None:
            return Placer(k=self.k, pending_ttl_s=self.pending_ttl_s, rng=rng, clock=clock)
        return Placer(k=self.k, pending_ttl_s=self.pending_ttl_s, rng=rng, clock=clock,
                      locality_bonus=self.locality_bonus, locality_k=self.locality_k)


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("random", k=1),                         # one uniform choice among nodes with room
    Policy("p2-stale", k=2, pending_ttl_s=0.0),    # power of two on the watcher's view alone
    Policy("p2", k=2),                             # + its own recent placements (the default)
    Policy("p3", k=3),
    Policy("p2+loc", k=2, locality_bonus=LOCALITY_BONUS),   # + image locality (the default bonus)
    Policy("p2+loc0.01", k=2, locality_bonus=0.01),
    Policy("p2+loc0.05", k=2, locality_bonus=0.05),
    Policy("p2+loc0.2", k=2, locality_bonus=0.2),
    Policy("p2+bonus-only", k=2, locality_bonus=LOCALITY_BONUS, locality_k=0),   # no extra candidates holding it
    Policy("p2+local-first", k=2, locality_bonus=10.0),   # a local node whenever one has room
)}
DEFAULT_POLICIES = ("random", "p2-stale", "p2", "p2+loc", "p2+local-first")


@dataclass
class Opts:
    nodes: int = 160
    live: int = 380_000
    rate: float = 5000.0
    duration_s: float = 30.0
    poll_s: float = 1.0
    images: int = 2000
    zipf: float = 1.0
    cache_images: int = 32
    hot_share: float = 0.2       # share of creations for one new image...
    hot_nodes: int = 2           # ...that only this many nodes hold at the start
    fail_every_s: float = 10.0
    down_s: float = 15.0
    sample_s: float = 1.0
    seed: int = 1
    policies: Sequence[str] = DEFAULT_POLICIES


class _FixedProbe(HostProbe):
    """No /proc: the simulated node has no PSI and plenty of free memory (only the capacity
    ceilings of admission apply)."""

    def read(self) -> Reading:
        return Reading(mem_available_mb=None, mem_total_mb=None, psi={})


class SimEdge:
    """The watcher's EdgeLike from simulated state, with the edge's real capacity check."""

    def __init__(self, node_id: str, capacity: NodeCapacity, cache_images: int):
        self.node_id = node_id
        self.capacity = capacity
        self.admission = Admission(capacity=capacity, probe=_FixedProbe())
        self.cpu_milli = 0
        self.memory_mb = 0
        self.sandboxes = 0
        self.up = True
        self.generation = 0        # bumped when the node dies: its sandboxes' departures are void
        self.cache = CacheSummary(cap=cache_images)

    async def status(self) -> NodeStatus:
        if not self.up:
            raise ConnectionError(f"{self.node_id} is down")
        return self._status()

    def _status(self) -> NodeStatus:
        return NodeStatus(node_id=self.node_id, healthy=True, backends=[BACKEND], capacity=self.capacity,
                          committed_cpu_cores=self.cpu_milli / 1000, committed_memory_mb=self.memory_mb,
                          sandboxes=self.sandboxes, cached_images=self.cache.keys())

    def create(self, cpu_milli: int, memory_mb: int, image: str) -> bool:
        """Admit and start; True if the image was cached here already."""
        if not self.up:
            raise Unavailable(f"{self.node_id} does not answer")
        st = NodeStatus.model_construct(node_id=self.node_id, healthy=True, backends=[BACKEND],
                                        capacity=self.capacity, committed_cpu_cores=self.cpu_milli / 1000,
                                        committed_memory_mb=self.memory_mb, sandboxes=self.sandboxes)
        self.admission.admit(st, cpu_milli / 1000, memory_mb)
        self._add(cpu_milli, memory_mb)
        return self.cache.add(image)

    def _add(self, cpu_milli: int, memory_mb: int, sign: int = 1) -> None:
        self.cpu_milli += sign * cpu_milli
        self.memory_mb += sign * memory_mb
        self.sandboxes += sign

    def load(self) -> float:
        c = self.capacity
        return max(self.cpu_milli / 1000 / c.cpu_cores, self.memory_mb / c.memory_mb,
                   self.sandboxes / c.max_sandboxes)

    def fail(self) -> int:
        lost, self.up = self.sandboxes, False
        self.generation += 1
        self.cpu_milli = self.memory_mb = self.sandboxes = 0
        return lost


@dataclass
class Result:
    policy: str
    arrivals: int = 0
    created: int = 0
    attempts: int = 0
    rejects_full: int = 0          # the edge's admission refused (stale view)
    rejects_down: int = 0          # the node had died since the last poll
    no_room: int = 0               # the placer found no node with room (the client sees 429)
    gave_up: int = 0               # every try refused
    hits: int = 0
    lost: int = 0
    decide_ns: list[int] = field(default_factory=list)        # wall clock of Placer.choose
    decide_cpu_ns: list[int] = field(default_factory=list)    # its thread CPU time (no preemption)
    view_ns: list[int] = field(default_factory=list)
    poll_ms: list[float] = field(default_factory=list)
    poll_cpu_ms: list[float] = field(default_factory=list)
    imbalance: list[tuple[float, float, int]] = field(default_factory=list)   # (t, max/mean, live)
    cpu_s: float = 0.0
    hot_per_node: dict[str, int] = field(default_factory=dict)   # creations of the new image per node

    def imbalances(self) -> list[float]:
        """max/mean samples after the start (the start is the same for every policy)."""
        return [x for t, x, _ in self.imbalance if t > 0]

    def pct(self, xs: Sequence[float], q: float) -> float:
        if not xs:
            return 0.0
        s = sorted(xs)
        return s[min(len(s) - 1, int(q * len(s)))]


def _digest(i: int) -> str:
    return "sha256:" + hashlib.sha256(f"image-{i}".encode()).hexdigest()


class _Trace:
    """The arrival trace, drawn from its own generator so every policy sees the same one."""

    def __init__(self, o: Opts):
        self.rng = random.Random(o.seed)
        self.images = [_digest(i) for i in range(o.images)]
        self.image_cum = list(accumulate(1 / (i + 1) ** o.zipf for i in range(o.images)))
        self.size_cum = list(accumulate(w for _, _, w in SIZES))
        self.mean_life = o.live / o.rate
        self.hot, self.hot_share = _digest(-1), o.hot_share
        self.prefill = True     # the new image appears once the simulation proper starts

    def request(self) -> tuple[int, int, str, float]:
        r = self.rng
        cpu, mem, _ = SIZES[bisect(self.size_cum, r.random() * self.size_cum[-1])]
        image = self.images[bisect(self.image_cum, r.random() * self.image_cum[-1])]
        if r.random() < self.hot_share and not self.prefill:
            image = self.hot
        return round(cpu * 1000), mem, image, r.expovariate(1 / self.mean_life)


def _imbalance(edges: Sequence[SimEdge]) -> tuple[float, int]:
    loads = [e.load() for e in edges if e.up]
    mean = statistics.fmean(loads) if loads else 0.0
    return (max(loads) / mean if mean > 0 else 1.0), sum(e.sandboxes for e in edges)


async def run_policy(o: Opts, policy: Policy) -> Result:
    res = Result(policy.name)
    trace = _Trace(o)
    fail_rng = random.Random(o.seed + 1)
    now = 0.0

    def clock() -> float:
        return now

    edges = [SimEdge(f"node-{i:03d}", HALF if i % 5 == 4 else FULL, o.cache_images) for i in range(o.nodes)]
    # (end time, seq, node index, node generation, cpu millicores, memory MiB)
    departures: list[tuple[float, int, int, int, int, int]] = []
    seq = 0
    total_slots = sum(e.capacity.max_sandboxes for e in edges)
    for i, e in enumerate(edges):   # balanced start: each node in proportion to its size
        for _ in range(round(o.live * e.capacity.max_sandboxes / total_slots)):
            cpu, mem, image, life = trace.request()
            e._add(cpu, mem)
            e.cache.add(image)
            departures.append((life, seq, i, 0, cpu, mem))
            seq += 1
    heapq.heapify(departures)
    trace.prefill = False
    for e in edges[:o.hot_nodes]:
        e.cache.add(trace.hot)
    # The simulator's own 380K departure records are nothing an apiserver holds: keep Python's
    # cyclic GC from scanning them and charging the pause to whichever decision runs then.
    gc.collect()
    gc.freeze()

    watcher = Watcher({e.node_id: e for e in edges}, interval_s=o.poll_s)
    await watcher.poll_once()
    placer = policy.placer(random.Random(o.seed + 2), clock)
    index = {e.node_id: i for i, e in enumerate(edges)}
    recoveries: list[tuple[float, int]] = []
    # failures fall between polls: until the next one, placement still sends the dead node work
    next_poll, next_fail, next_sample = o.poll_s, o.fail_every_s + 0.5 * o.poll_s, 0.0

    def depart_until(t: float) -> None:
        while departures and departures[0][0] <= t:
            _, _, i, gen, cpu, mem = heapq.heappop(departures)
            if edges[i].generation == gen:
                edges[i]._add(cpu, mem, -1)

    async def advance(t: float) -> None:
        nonlocal now, next_poll, next_fail, next_sample
        while True:
            due = min(next_poll, next_fail, next_sample, recoveries[0][0] if recoveries else t + 1)
            if due > t:
                break
            depart_until(due)
            now = due
            if due == next_sample:
                ratio, live = _imbalance(edges)
                res.imbalance.append((now, ratio, live))
                next_sample += o.sample_s
            elif recoveries and due == recoveries[0][0]:
                edges[heapq.heappop(recoveries)[1]].up = True
            elif due == next_fail:
                up = [i for i, e in enumerate(edges) if e.up]
                victim = fail_rng.choice(up)
                res.lost += edges[victim].fail()
                heapq.heappush(recoveries, (now + o.down_s, victim))
                next_fail += o.fail_every_s
            else:
                t0, c0 = time.perf_counter(), time.thread_time()
                await watcher.poll_once()
                res.poll_ms.append((time.perf_counter() - t0) * 1000)
                res.poll_cpu_ms.append((time.thread_time() - c0) * 1000)
                next_poll += o.poll_s
        depart_until(t)
        now = t

    cpu0 = time.process_time()
    t = 0.0
    while True:
        t += trace.rng.expovariate(o.rate)
        if t >= o.duration_s:
            break
        cpu, mem, image, life = trace.request()
        await advance(t)
        res.arrivals += 1
        excluded: set[str] = set()
        want = image if policy.locality_bonus is not None else None
        for _ in range(PLACEMENT_TRIES):
            t0 = time.perf_counter_ns()
            view = watcher.nodes()
            c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                node = (placer.choose(view, BACKEND, cpu / 1000, mem, exclude=excluded, image=want)
                        if want is not None else placer.choose(view, BACKEND, cpu / 1000, mem, exclude=excluded))
            except CapacityExceeded:
                res.no_room += 1
                break
            finally:
                res.decide_ns.append(time.perf_counter_ns() - t1)
                res.decide_cpu_ns.append(time.thread_time_ns() - c1)
            res.view_ns.append(t1 - t0)
            res.attempts += 1
            i = index[node]
            try:
                hit = edges[i].create(cpu, mem, image)
            except CapacityExceeded:
                placer.release(node, cpu / 1000, mem)
                excluded.add(node)
                res.rejects_full += 1
                continue
            except Unavailable:
                placer.release(node, cpu / 1000, mem)
                excluded.add(node)
                res.rejects_down += 1
                continue
            placer.landed(node, cpu / 1000, mem, o.poll_s)
            res.created += 1
            res.hits += hit
            if image == trace.hot:
                res.hot_per_node[node] = res.hot_per_node.get(node, 0) + 1
            heapq.heappush(departures, (now + life, seq, i, edges[i].generation, cpu, mem))
            seq += 1
            break
        else:
            res.gave_up += 1
    await advance(o.duration_s)
    if res.imbalance[-1][0] < now:
        ratio, live = _imbalance(edges)
        res.imbalance.append((now, ratio, live))
    res.cpu_s = time.process_time() - cpu0
    gc.unfreeze()
    return res


def run(o: Opts) -> list[Result]:
    unknown = [p for p in o.policies if p not in POLICIES]
    if unknown:
        from dsec.types import InvalidArgument
        raise InvalidArgument(f"unknown policies {unknown}", field="policies",
                              fix=f"choose among {', '.join(POLICIES)}")
    return [asyncio.run(run_policy(o, POLICIES[p])) for p in o.policies]


def report(o: Opts, results: Sequence[Result]) -> str:
    """A markdown table, side by side, with ratios against the first policy."""
    base = results[0]
    lines = [
        f"{o.nodes} nodes (a fifth half size), {o.live:,} live sandboxes at start, {o.rate:,.0f} "
        f"creations/s for {o.duration_s:g} s of simulated time, watcher poll every {o.poll_s:g} s, "
        f"{o.images} images (Zipf {o.zipf:g}), {o.cache_images} cached per node, {o.hot_share:.0%} of "
        f"creations for a new image that {o.hot_nodes} nodes hold at the start, one node dies every "
        f"{o.fail_every_s:g} s for {o.down_s:g} s; seed {o.seed}. Imbalance statistics over 1 s samples "
        "after the start; decision times are Placer.choose alone (the watcher's nodes() is `view`).",
        "",
        "| policy | decision p50 µs | p99 µs | CPU p50 µs | CPU p99 µs | view p50 µs | imbalance mean | p99 | "
        "max | final | edge rejects % | retries % | no room | locality hit % | new image: nodes, top node % | "
        "lost | sim CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        imb = r.imbalances()
        hot = sum(r.hot_per_node.values())
        lines.append(
            f"| {r.policy} | {r.pct(r.decide_ns, .5) / 1000:.1f} | {r.pct(r.decide_ns, .99) / 1000:.1f} | "
            f"{r.pct(r.decide_cpu_ns, .5) / 1000:.1f} | {r.pct(r.decide_cpu_ns, .99) / 1000:.1f} | "
            f"{r.pct(r.view_ns, .5) / 1000:.1f} | {statistics.fmean(imb):.3f} | {r.pct(imb, .99):.3f} | "
            f"{max(imb):.3f} | {imb[-1]:.3f} | "
            f"{100 * r.rejects_full / max(r.attempts, 1):.3f} | "
            f"{100 * (r.attempts - r.created) / max(r.arrivals, 1):.3f} | {r.no_room} | "
            f"{100 * r.hits / max(r.created, 1):.1f} | "
            f"{len(r.hot_per_node)}, {100 * max(r.hot_per_node.values(), default=0) / max(hot, 1):.1f} | "
            f"{r.lost:,} | {r.cpu_s:.1f} |")
    lines += ["", f"Ratios against `{base.policy}` (lower is better for all but locality):", "",
              "| policy | imbalance excess (max/mean - 1) | edge rejects | decision p99 | locality misses |",
              "|---|---|---|---|---|"]

    def excess(r: Result) -> float:
        return statistics.fmean(r.imbalances()) - 1

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b > 0 else ("1.00x" if a == 0 else "inf")

    for r in results:
        lines.append(f"| {r.policy} | {ratio(excess(r), excess(base))} | "
                     f"{ratio(r.rejects_full, base.rejects_full)} | "
                     f"{ratio(r.pct(r.decide_ns, .99), base.pct(base.decide_ns, .99))} | "
                     f"{ratio(r.created - r.hits, base.created - base.hits)} |")
    lines += ["", "Imbalance (max/mean of committed load, healthy nodes) over simulated time:", "",
              "| t s | " + " | ".join(r.policy for r in results) + " |",
              "|---|" + "---|" * len(results)]
    for j, (t, _, live) in enumerate(base.imbalance):
        if j % 5 and j != len(base.imbalance) - 1:
            continue
        row = " | ".join(f"{r.imbalance[j][1]:.3f}" if j < len(r.imbalance) else "" for r in results)
        lines.append(f"| {t:.0f} ({live:,} live) | {row} |")
    poll = [p for r in results for p in r.poll_ms]
    poll_cpu = [p for r in results for p in r.poll_cpu_ms]
    lines += ["", f"Watcher poll_once over {o.nodes} simulated edges: wall p50 {statistics.median(poll):.1f} ms, "
                  f"max {max(poll):.1f} ms; CPU p50 {statistics.median(poll_cpu):.1f} ms, "
                  f"max {max(poll_cpu):.1f} ms."]
    return "\n".join(lines)
