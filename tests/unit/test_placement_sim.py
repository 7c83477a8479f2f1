"""A small run of `dsec bench cluster-sim` (the real Placer and Watcher over simulated edges,
D34): the bounds the full-size run is read against hold at a size that takes seconds."""

from __future__ import annotations

import pytest

from dsec.bench.cluster_sim import Opts, report, run
from dsec.types import InvalidArgument


@pytest.fixture(scope="module")
def results():   # type: ignore[no-untyped-def]
    # two nodes die mid-run and stay down (a node back empty lowers the mean: the full run shows it)
    o = Opts(nodes=16, live=12_000, rate=300.0, duration_s=12.0, fail_every_s=5.0, down_s=20.0,
             images=200, cache_images=16, policies=("random", "p2", "p2+loc", "p2+local-first"))
    return o, {r.policy: r for r in run(o)}


def test_power_of_two_with_own_placements_stays_balanced(results):   # type: ignore[no-untyped-def]
    _, r = results
    p2, rnd = r["p2"], r["random"]
    assert max(p2.imbalances()) < 1.04
    assert max(rnd.imbalances()) > max(p2.imbalances()) + 0.1
    # every creation was placed: refusals (dead nodes until the next poll) were retried elsewhere
    assert p2.gave_up == 0 and p2.no_room == 0 and p2.created == p2.arrivals
    assert p2.rejects_down > 0 and p2.lost > 0


def test_locality_raises_hits_without_giving_up_balance(results):   # type: ignore[no-untyped-def]
    _, r = results
    p2, loc, first = r["p2"], r["p2+loc"], r["p2+local-first"]
    assert loc.hits / loc.created > p2.hits / p2.created + 0.15
    assert max(loc.imbalances()) < 1.08
    # always preferring a node that holds the image piles the new image onto its two nodes
    assert len(first.hot_per_node) <= 3 < len(loc.hot_per_node)
    assert max(first.imbalances()) > max(loc.imbalances()) + 0.1


def test_report_is_side_by_side(results):   # type: ignore[no-untyped-def]
    o, r = results
    text = report(o, list(r.values()))
    assert "| p2+loc |" in text and "Ratios against `random`" in text and "locality hit %" in text


def test_unknown_policy_names_the_field():
    with pytest.raises(InvalidArgument) as e:
        run(Opts(policies=("p7",)))
    assert e.value.field == "policies" and "p2+loc" in (e.value.fix or "")
