"""Project sandbox policy (dsec.iam.policy): a sandbox may loosen only what its project allows,
and a child project can only narrow its parent's policy. Real server, real crun sandboxes,
real HTTP; projects and keys are made in the server's own IAM database."""

from __future__ import annotations

import json
import os

import pytest

from dsec.iam import IAM
from dsec.sdk.client import Client
from dsec.types import Forbidden

RULESETS = {"pol-a": {"rules": [{"cidr": "10.99.1.0/24", "ports": 80}]},
            "pol-b": {"rules": [{"cidr": "10.99.2.0/24", "ports": 80}]}}


@pytest.fixture
def rulesets(server):
    """Two operator rule sets, added to (and afterwards removed from) the server's file."""
    path = server.home / "network-rulesets.json"
    before = path.read_text() if path.exists() else None
    path.write_text(json.dumps({**(json.loads(before) if before else {}), **RULESETS}))
    yield
    if before is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(before)


@pytest.fixture
def tree(server):
    """root -> parent -> child projects, each with a key."""
    suffix = os.urandom(3).hex()
    with IAM(server.paths.iam_db) as iam:
        parent = iam.create_project(f"pol-parent-{suffix}", iam.root().id)
        child = iam.create_project(f"pol-child-{suffix}", parent.id)
        return {"parent": parent.id, "child": child.id,
                "parent_key": iam.create_key(parent.id), "child_key": iam.create_key(child.id)}


async def test_child_policy_only_narrows_and_is_inherited(server, tree):
    """The root sets a parent's policy; the parent may narrow its child's, never widen it (rule sets, networks, limits, root); a project cannot set its own; the effective policy is the intersection and follows later changes of the parent."""
    async with server.client() as admin, Client(server.url, tree["parent_key"]) as parent, \
            Client(server.url, tree["child_key"]) as child:
        await admin.set_policy(tree["parent"], {"rulesets": ["pol-a", "pol-b"], "cidrs": ["10.0.0.0/8"],
                                                "max_memory_mb": 1024, "allow_root": False})
        await parent.set_policy(tree["child"], {"rulesets": ["pol-a"], "max_memory_mb": 512})
        for wider, field in (({"rulesets": ["pol-a", "other"]}, "rulesets"), ({"cidrs": ["0.0.0.0/0"]}, "cidrs"),
                             ({"max_memory_mb": 2048}, "max_memory_mb"), ({"allow_root": True}, "allow_root")):
            with pytest.raises(Forbidden) as e:
                await parent.set_policy(tree["child"], wider)
            assert e.value.field == field and "parent" in (e.value.fix or ""), e.value
        with pytest.raises(Forbidden) as e:                    # loosening itself
            await child.set_policy(tree["child"], {})
        assert e.value.field == "project_id"
        eff = (await child.get_policy(tree["child"]))["effective"]
        assert eff == {"egress": None, "rulesets": ["pol-a"], "cidrs": ["10.0.0.0/8"], "allow_root": False, "max_cpu_cores": None,
                       "max_memory_mb": 512, "max_disk_mb": None, "max_pids_limit": None, "max_nofile": None,
                       "max_output_cap_bytes": None, "max_output_total_bytes": None}, eff
        await admin.set_policy(tree["parent"], {"rulesets": [], "max_memory_mb": 256})   # parent narrows later
        eff = (await child.get_policy(tree["child"]))["effective"]
        assert eff["rulesets"] == [] and eff["max_memory_mb"] == 256 and eff["cidrs"] is None, eff


async def test_create_set_network_and_exec_bounded_by_project_policy(server, tree, rulesets):
    """Creating a sandbox, changing its network and running a command may loosen only what the project's effective policy allows: each refusal is 403 naming the field, with a fix; what is allowed works on a real sandbox."""
    async with server.client() as admin, Client(server.url, tree["child_key"]) as child:
        await admin.set_policy(tree["parent"], {"rulesets": ["pol-a"], "cidrs": ["10.0.0.0/8"], "max_memory_mb": 512,
                                                "allow_root": False, "max_output_cap_bytes": 1 << 20})
        refused = [({"memory_mb": 1024}, "memory_mb"), ({"user": "root"}, "user"), ({"user": "00:1000"}, "user"),
                   ({"output_cap_bytes": 4 << 20}, "output_cap_bytes"),
                   ({"network": {"rulesets": {"pol-b": True}}}, "network.rulesets.pol-b"),
                   ({"network": {"rules": [{"cidr": "192.168.0.0/16"}]}}, "network.rules.0.cidr")]
        for extra, field in refused:
            with pytest.raises(Forbidden) as e:
                await child.create_container(image="busybox", **extra)
            assert e.value.field == field and "policy" in (e.value.fix or ""), (field, e.value)
            if field == "memory_mb":
                assert "memory_mb=512" in e.value.fix, e.value.fix
        sb = await child.create_container(image="busybox", memory_mb=256, network={
            "rulesets": {"pol-a": True, "pol-b": False}, "rules": [{"cidr": "10.1.2.3", "ports": 443}]})
        try:
            for policy, field in (({"rulesets": {"pol-b": True}}, "rulesets.pol-b"),
                                  ({"rules": [{"cidr": "8.8.8.8"}]}, "rules.0.cidr")):
                with pytest.raises(Forbidden) as e:
                    await sb.set_network(**policy)
                assert e.value.field == field, e.value
            await sb.set_network(rulesets={"pol-a": False})        # narrowing is always fine
            with pytest.raises(Forbidden) as e:
                await sb.run("id -u", user="root")
            assert e.value.field == "user"
            assert (await sb.run("id -u")).stdout == "1000\n"
            await admin.set_policy(tree["parent"], {"rulesets": []})   # the parent takes pol-a away
            with pytest.raises(Forbidden):
                await sb.set_network(rulesets={"pol-a": True})
        finally:
            await sb.stop()
