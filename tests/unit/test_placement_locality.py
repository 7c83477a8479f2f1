"""Image locality in placement (D34): the edge's summary of the images it holds, carried in its
status, and the placer preferring those nodes without giving up load balance."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import Counter

import pytest

from dsec.edge.edge import Edge
from dsec.placement import Placer
from dsec.placement.locality import SUMMARY_CAP, CacheSummary, image_key
from dsec.placement.placer import LOCALITY_BONUS
from dsec.testing.fake_backend import FakeBackend
from dsec.types import CapacityExceeded, ContainerArgs, NodeCapacity, NodeStatus


def digest(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


IMG = digest("debian-python")
OTHER = digest("busybox")


def node(i: int | str, *, n: int = 0, slots: int = 1000, healthy: bool = True, images: tuple[str, ...] = (),
         backends: tuple[str, ...] = ("container",)) -> NodeStatus:
    return NodeStatus(node_id=f"n{i}" if isinstance(i, int) else i, healthy=healthy, backends=list(backends),
                      capacity=NodeCapacity(cpu_cores=1000.0, memory_mb=1 << 30, max_sandboxes=slots),
                      sandboxes=n, cached_images=frozenset(image_key(d) for d in images))


# -- the summary the edge keeps ---------------------------------------------------------------

def test_summary_is_a_bounded_lru_of_short_keys():
    s = CacheSummary(cap=3)
    assert image_key(IMG) == IMG[7:23] and image_key(IMG[7:]) == IMG[7:23]
    assert not s.add(digest("a")) and not s.add(digest("b")) and not s.add(digest("c"))
    assert s.add(digest("a"))                   # a hit; "a" is now the most recent
    s.add(digest("d"))                          # evicts the least recently used: "b"
    assert digest("b") not in s and digest("a") in s and len(s) == 3
    assert s.keys() == {image_key(digest(x)) for x in "acd"}
    s.discard(digest("c"))
    assert s.keys() == {image_key(digest(x)) for x in "ad"}
    assert CacheSummary().cap == SUMMARY_CAP


def test_summary_set_is_rebuilt_only_when_membership_changes():
    # the edge hands this set out on every status(): hits must not rebuild it (D25: O(1))
    s = CacheSummary()
    s.add(IMG)
    first = s.keys()
    for _ in range(100):
        s.add(IMG)
    assert s.keys() is first
    s.add(OTHER)
    assert s.keys() is not first and s.keys() == {image_key(IMG), image_key(OTHER)}


def test_status_carries_the_summary_over_json():
    st = node(0, images=(IMG, OTHER))
    back = NodeStatus.model_validate_json(st.model_dump_json())
    assert back.cached_images == st.cached_images and isinstance(back.cached_images, frozenset)
    # an edge that predates the field reports none
    assert NodeStatus.model_validate(st.model_dump(exclude={"cached_images"})).cached_images == frozenset()


async def test_edge_status_lists_the_images_it_created_from(edge: Edge, fake: FakeBackend,
                                                          monkeypatch: pytest.MonkeyPatch):
    prepare = fake.prepare

    async def with_digest(args, images):   # type: ignore[no-untyped-def]
        # the fake backend resolves no image; a real one returns the image's digest here
        return dataclasses.replace(await prepare(args, images), image_digest=IMG)

    monkeypatch.setattr(fake, "prepare", with_digest)
    assert (await edge.status()).cached_images == frozenset()
    await edge.create("p", ContainerArgs(image="busybox"))
    assert (await edge.status()).cached_images == {image_key(IMG)}
    await edge.create("p", ContainerArgs(image="busybox"))
    st = await edge.status()
    assert st.cached_images == {image_key(IMG)} and st.sandboxes == 2


# -- the placer --------------------------------------------------------------------------------

def test_prefers_a_node_that_holds_the_image():
    # 2 of 40 equally loaded nodes hold the image: a uniform pair would hit one 10% of the time
    nodes = [node(i, images=(IMG,) if i in (7, 30) else ()) for i in range(40)]
    picks = Counter(Placer(k=2, rng=random.Random(s)).choose(nodes, "container", 1.0, 512, image=IMG)
                    for s in range(200))
    assert set(picks) == {"n7", "n30"}
    # without the image in the request the same placer spreads uniformly
    plain = Counter(Placer(k=2, rng=random.Random(s)).choose(nodes, "container", 1.0, 512) for s in range(200))
    assert plain["n7"] + plain["n30"] < 40 and len(plain) > 30


def test_locality_gives_way_to_load():
    assert LOCALITY_BONUS == 0.02
    # the node holding the image is 3 points fuller than the other: the bonus (2) does not cover it
    nodes = [node("local", n=230, images=(IMG,)), node("idle", n=200)]
    placer = Placer(k=2, rng=random.Random(0))
    assert placer.choose(nodes, "container", 1.0, 512, image=IMG) == "idle"
    # within the bonus it wins
    nodes = [node("local", n=215, images=(IMG,)), node("idle", n=200)]
    assert Placer(k=2, rng=random.Random(0)).choose(nodes, "container", 1.0, 512, image=IMG) == "local"
    with pytest.raises(Exception, match="locality_bonus"):
        Placer(locality_bonus=-1)


def test_a_burst_of_one_image_does_not_pile_onto_the_nodes_holding_it():
    # 2,000 creations of one image on one stale snapshot: 3 of 20 nodes hold it. They take at
    # most the bonus (2% of 1,000 slots = 20) more than the rest; the rest still share the burst.
    nodes = [node(i, images=(IMG,) if i < 3 else ()) for i in range(20)]
    placer = Placer(k=2, rng=random.Random(4))
    counts = Counter(placer.choose(nodes, "container", 1.0, 512, image=IMG) for _ in range(2000))
    others = [counts[f"n{i}"] for i in range(3, 20)]
    assert min(others) > 0
    assert max(counts[f"n{i}"] for i in range(3)) <= max(others) + 20 + 2
    assert max(counts.values()) <= 2000 / 20 + 20 + 2


def test_health_backend_and_refusals_override_locality():
    nodes = [node("sick", healthy=False, images=(IMG,)), node("vm", images=(IMG,), backends=("microvm",)),
             node("refused", images=(IMG,)), node("full", slots=5, n=5, images=(IMG,)),
             node("plain1"), node("plain2")]
    for s in range(50):
        got = Placer(k=2, rng=random.Random(s)).choose(nodes, "container", 1.0, 512, exclude={"refused"}, image=IMG)
        assert got in ("plain1", "plain2")
    with pytest.raises(CapacityExceeded, match="none of the 1 nodes is healthy"):
        Placer().choose([node("sick", healthy=False, images=(IMG,))], "container", 1.0, 512, image=IMG)


def test_locality_bonus_zero_turns_it_off():
    nodes = [node(i, images=(IMG,) if i == 0 else ()) for i in range(40)]
    picks = Counter(Placer(k=2, rng=random.Random(s), locality_bonus=0).choose(nodes, "container", 1.0, 512,
                                                                                 image=IMG)
                    for s in range(200))
    assert picks["n0"] < 30
