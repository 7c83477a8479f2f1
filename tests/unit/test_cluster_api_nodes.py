"""`cluster up --api-nodes`: replicas pinned to named nodes (their `dsec_node:<name>` resource,
a share of it beside the node's edge), one per name, or one on every live named node; a name
no live raylet offers is refused naming the option."""

from __future__ import annotations

import pytest

from dsec.cluster.names import EDGE_SHARE, REPLICA_SHARE, RESOURCE_PREFIX
from dsec.cluster.ray_cluster import ClusterSettings, replica_placements
from dsec.types import InvalidArgument

LIVE = {"a", "b", "c"}


def test_named_nodes_get_one_pinned_replica_each():
    got = replica_placements(ClusterSettings(api_nodes=["a", "c"], replicas=5), LIVE)
    assert got == {"dsec-api-on-a": {"resources": {RESOURCE_PREFIX + "a": REPLICA_SHARE}},
                   "dsec-api-on-c": {"resources": {RESOURCE_PREFIX + "c": REPLICA_SHARE}}}
    assert EDGE_SHARE + REPLICA_SHARE <= 1       # both fit the one unit a raylet offers


def test_all_means_every_live_named_node():
    assert sorted(replica_placements(ClusterSettings(api_nodes=["all"]), LIVE)) == \
        ["dsec-api-on-a", "dsec-api-on-b", "dsec-api-on-c"]


def test_default_spreads_numbered_replicas():
    got = replica_placements(ClusterSettings(replicas=2), LIVE)
    assert got == {"dsec-api-0": {"scheduling_strategy": "SPREAD"}, "dsec-api-1": {"scheduling_strategy": "SPREAD"}}


@pytest.mark.parametrize("names", [["a", "zz"], ["Bad_Name"]])
def test_unknown_or_invalid_names_are_refused(names):
    with pytest.raises(InvalidArgument) as e:
        replica_placements(ClusterSettings(api_nodes=names), LIVE)
    assert e.value.field == "api_nodes"


def test_cli_passes_the_options(monkeypatch):
    """`dsec cluster up --api-nodes a,b --edge-plain-http` reaches ClusterSettings as lists/flags."""
    from typer.testing import CliRunner

    from dsec.cluster import cli
    from dsec.cluster import ray_cluster as rc
    seen = {}

    async def fake_up(settings):     # Ray is not started here: only the parsing is under test
        seen["s"] = settings
        return {}
    monkeypatch.setattr(rc, "up", fake_up)
    monkeypatch.setattr(cli, "_connect", lambda address: None)
    r = CliRunner().invoke(cli.cluster_app, ["up", "--api-nodes", "a, b", "--edge-plain-http"])
    assert r.exit_code == 0, r.output
    assert seen["s"].api_nodes == ["a", "b"] and seen["s"].edge_tls is False
    r = CliRunner().invoke(cli.cluster_app, ["up"])
    assert r.exit_code == 0, r.output
    assert seen["s"].api_nodes == [] and seen["s"].edge_tls is True
