"""Placement between watcher polls (D34): many decisions on one stale snapshot stay balanced
through the placer's own reservations; a new snapshot folds them in; sampling stays uniform
among the nodes that qualify however many do not."""

from __future__ import annotations

import random
from collections import Counter

from dsec.placement import Placer
from dsec.types import NodeCapacity, NodeStatus


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def node(i: int, *, n: int = 0, slots: int = 4000, healthy: bool = True, half: bool = False) -> NodeStatus:
    f = 0.5 if half else 1.0
    return NodeStatus(node_id=f"n{i:03d}", healthy=healthy, backends=["container"],
                      capacity=NodeCapacity(cpu_cores=4000 * f, memory_mb=int(8_000_000 * f),
                                            max_sandboxes=int(slots * f)),
                      sandboxes=n, committed_cpu_cores=float(n), committed_memory_mb=2048 * n)


def spread(counts: Counter[str], nodes: list[NodeStatus]) -> float:
    """max/mean of the load the placements added, relative to each node's size."""
    loads = [counts[n.node_id] / n.capacity.max_sandboxes for n in nodes if n.healthy]
    return max(loads) / (sum(loads) / len(loads))


def test_a_second_of_creations_on_one_snapshot_stays_balanced():
    # 5,000 placements (one second at the reference's rate) over 160 nodes, a fifth of them half
    # size, all on the same view: own reservations keep them within a few percent of even
    clock = Clock()
    view = [node(i, half=i % 5 == 4) for i in range(160)]
    placer = Placer(k=2, rng=random.Random(1), clock=clock)
    counts = Counter(placer.choose(view, "container", 1.0, 2048) for _ in range(5000))
    assert spread(counts, view) < 1.15
    # the same burst without reservations (ttl 0: the view alone) is far less even
    blind = Placer(k=2, pending_ttl_s=0.0, rng=random.Random(1), clock=clock)
    blind_counts = Counter(blind.choose(view, "container", 1.0, 2048) for _ in range(5000))
    assert spread(blind_counts, view) > 1.5


def test_a_new_snapshot_folds_in_what_it_already_counts():
    clock = Clock()
    placer = Placer(k=2, rng=random.Random(2), clock=clock)
    view = [node(i) for i in range(10)]
    for _ in range(100):
        placer.choose(view, "container", 1.0, 2048)
    assert sum(placer.pending(f"n{i:03d}")[2] for i in range(10)) == 100
    # passing the same snapshot again (a new list of the same objects) keeps every reservation
    placer.choose(list(view), "container", 1.0, 2048)
    landed = {f"n{i:03d}": placer.pending(f"n{i:03d}")[2] for i in range(10)}
    assert sum(landed.values()) == 101
    # a poll that shows only some of them drops exactly those
    placer.observe([node(i, n=landed[f"n{i:03d}"] if i < 5 else 0) for i in range(10)])
    assert all(placer.pending(f"n{i:03d}")[2] == (0 if i < 5 else landed[f"n{i:03d}"]) for i in range(10))
    # the next one lands the rest
    placer.observe([node(i, n=landed[f"n{i:03d}"]) for i in range(10)])
    assert all(placer.pending(f"n{i:03d}") == (0.0, 0, 0) for i in range(10))


def test_reservations_expire_on_the_virtual_clock_after_landing():
    clock = Clock()
    placer = Placer(k=2, pending_ttl_s=2.0, rng=random.Random(3), clock=clock)
    view = [node(i) for i in range(4)]
    chosen = [placer.choose(view, "container", 0.5, 1024) for _ in range(40)]
    for c in chosen[:20]:
        assert placer.landed(c, 0.5, 1024, visible_within_s=1.0)
    clock.t = 1.0     # the landed ones are due now, the others keep their 2 s
    assert sum(placer.pending(f"n{i:03d}")[2] for i in range(4)) == 20
    clock.t = 2.0
    assert sum(placer.pending(f"n{i:03d}")[2] for i in range(4)) == 0


def test_sampling_among_few_qualifying_nodes_stays_uniform():
    # 150 of 160 nodes are down: candidates come from the 10 healthy ones only, evenly
    view = [node(i, healthy=i % 16 == 0) for i in range(160)]
    placer = Placer(k=2, pending_ttl_s=0.0, rng=random.Random(5))
    counts = Counter(placer.choose(view, "container", 1.0, 2048) for _ in range(3000))
    assert set(counts) == {f"n{i:03d}" for i in range(0, 160, 16)}
    assert min(counts.values()) > 200     # 300 each on average


def test_full_nodes_are_skipped_without_scanning_bias():
    # all but three nodes are full: only those three are ever chosen, each about a third
    view = [node(i, n=4000) if i not in (3, 80, 150) else node(i) for i in range(160)]
    placer = Placer(k=2, pending_ttl_s=0.0, rng=random.Random(6))
    counts = Counter(placer.choose(view, "container", 1.0, 2048) for _ in range(900))
    assert set(counts) == {"n003", "n080", "n150"} and min(counts.values()) > 200
