"""A project's egress (issue 25 item 3): one field of its policy, a ceiling no create can lift,
and the E2B mount's default (E2B's internet on) where it allows it. Real server, real sandboxes,
the stock e2b SDK and dsec's own."""

from __future__ import annotations

import os

import pytest

from dsec.iam import IAM
from dsec.sdk.client import Client
from dsec.types import Forbidden

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")
from e2b import Sandbox  # noqa: E402
from e2b.exceptions import SandboxException  # noqa: E402

INTERNET = ["0.0.0.0/0", "::/0"]


@pytest.fixture(scope="module")
def projects(server):
    """Three projects under the root (egress none, rulesets, unset) with a key each."""
    suffix = os.urandom(3).hex()
    out = {}
    with IAM(server.paths.iam_db) as iam:
        for name in ("none", "rulesets", "open"):
            p = iam.create_project(f"egress-{name}-{suffix}", iam.root().id)
            out[name] = (p.id, iam.create_key(p.id))
    return out


async def test_egress_field_is_a_ceiling_no_create_lifts(server, projects):
    none_id, none_key = projects["none"]
    rs_id, rs_key = projects["rulesets"]
    async with server.client() as admin, Client(server.url, none_key) as off, Client(server.url, rs_key) as rs:
        await admin.set_policy(none_id, {"egress": "none"})
        await admin.set_policy(rs_id, {"egress": "rulesets"})
        for c, extra, field in ((off, {"rules": [{"cidr": "10.0.0.0/8"}]}, "network.rules.0.cidr"),
                                (off, {"domains": ["pypi.org"]}, "network.domains"),
                                (off, {"rulesets": {"pypi": True}}, "network.rulesets.pypi"),
                                (rs, {"rules": [{"cidr": "0.0.0.0/0"}]}, "network.rules.0.cidr"),
                                (rs, {"domains": ["pypi.org"]}, "network.domains")):
            with pytest.raises(Forbidden) as e:
                await c.create_container(image="busybox", network=extra)
            assert e.value.field == field and "egress=" in e.value.message, e.value
            assert "policy" in (e.value.fix or ""), e.value
        # egress='rulesets' lets rule sets through to the edge (which knows no 'no-such-set': 422)
        from dsec.types import InvalidArgument
        with pytest.raises(InvalidArgument) as e:
            await rs.create_container(image="busybox", network={"rulesets": {"no-such-set": True}})
        assert e.value.field == "network.rulesets.no-such-set", e.value
        sb = await off.create_container(image="busybox")           # asking nothing is fine
        try:
            assert not sb.info.network.rules and not sb.info.network.domains
            with pytest.raises(Forbidden) as e:                       # nor can set_network lift it
                await sb.set_network(rules=[{"cidr": "10.0.0.0/8"}])
            assert e.value.field == "rules.0.cidr" and "egress='none'" in e.value.message, e.value
        finally:
            await sb.stop()
        # a child may narrow it, never widen it
        with IAM(server.paths.iam_db) as iam:
            child = iam.create_project(f"egress-child-{os.urandom(3).hex()}", none_id)
        with pytest.raises(Forbidden) as e:
            await off.set_policy(child.id, {"egress": "internet"})
        assert e.value.field == "egress", e.value
        await off.set_policy(child.id, {})
        assert (await off.get_policy(child.id))["effective"]["egress"] == "none"


def _e2b(key: str) -> dict:
    return {"api_key": key}


def test_e2b_create_gets_the_internet_where_the_project_allows_it(e2b_env, server, projects):
    """E2B's default (allow_internet_access unset): the internet on under a project whose egress
    allows it; none (and no error) under egress='none', where asking for it is refused by name."""
    sbx = Sandbox.create("busybox")                        # the root project: no restriction
    try:
        assert sbx.get_info().allow_internet_access is True
    finally:
        sbx.kill()
    none_id, none_key = projects["none"]
    with IAM(server.paths.iam_db) as iam:
        from dsec.iam.policy import SandboxPolicy
        iam.set_policy(none_id, SandboxPolicy(egress="none"))
        open_id, open_key = projects["open"]
        iam.set_policy(open_id, SandboxPolicy(cidrs=["10.0.0.0/8"]))   # internet beyond its networks
    for key in (none_key, open_key):
        sbx = Sandbox.create("busybox", **_e2b(key))
        try:
            assert sbx.get_info().allow_internet_access is False, key
        finally:
            sbx.kill()
    with pytest.raises(SandboxException, match="egress='none'"):
        Sandbox.create("busybox", allow_internet_access=True, **_e2b(none_key))
    sbx = Sandbox.create("busybox", **_e2b(none_key))
    try:       # update_network with nothing said: E2B's default, as the project allows it (none)
        sbx.update_network({})
        assert sbx.get_info().allow_internet_access is False
        with pytest.raises(SandboxException, match="egress='none'"):
            sbx.update_network({"allow_out": ["10.0.0.1"]})
    finally:
        sbx.kill()
    sbx = Sandbox.create("busybox", allow_internet_access=False)      # asked off: off
    try:
        assert sbx.get_info().allow_internet_access is False
    finally:
        sbx.kill()


async def test_e2b_default_internet_is_the_native_allow_list(e2b_env, server):
    sbx = Sandbox.create("busybox")
    try:
        async with server.client() as c:
            from dsec.apiserver.e2b.ids import to_dsec
            info = (await c.get(to_dsec(sbx.sandbox_id))).info
            assert sorted(r.cidr for r in info.network.rules) == sorted(INTERNET), info.network
    finally:
        sbx.kill()
