"""The stock e2b SDK's egress by domain (network={"allow_out": [...], "deny_out": [...]}) and
update_network (PUT /sandboxes/{id}/network) against a real dsec server whose DNS forwarder and
HTTP/HTTPS peers are local (tests/egress_peer.py)."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from egress_peer import PROBE, dserver, peer  # noqa: F401 (fixtures)

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")
from e2b import Sandbox  # noqa: E402
from e2b.exceptions import SandboxException  # noqa: E402


@pytest.fixture(scope="module")
def e2b_at(dserver):
    mp = pytest.MonkeyPatch()
    url = f"{dserver.url}/e2b"
    for k, v in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": dserver.key,
                 "E2B_DOMAIN": "dsec.invalid"}.items():
        mp.setenv(k, v)
    mp.delenv("E2B_DEBUG", raising=False)
    yield url
    mp.undo()


def probe(sbx: Sandbox, checks: list[list]) -> dict:
    sbx.files.write("/tmp/eprobe.py", PROBE)
    r = sbx.commands.run(f"python3 /tmp/eprobe.py '{json.dumps(checks)}'", user="root", timeout=90)
    return json.loads(r.stdout)


def test_allow_out_domains_and_update_network(e2b_at, peer):
    sbx = Sandbox.create("debian-python", network={"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]})
    try:
        assert sbx.get_info()  # served
        r = probe(sbx, [["http", "http", "allowed.test", 80, "allowed.test"],
                        ["https", "https", "allowed.test", 443, "allowed.test"],
                        ["other", "http", peer.ip, 80, "other.test"],
                        ["dns_other", "resolve", "other.test"],
                        ["raw", "tcp", peer.ip2, 8080]])
        assert r["http"] == f"ok:200 {peer.ip} allowed.test -", r
        assert r["https"] == f"ok:{peer.ip} allowed.test allowed.test", r
        assert r["other"].startswith("ok:403") and r["dns_other"].startswith("err:gaierror"), r
        assert r["raw"] == "err:PermissionError:1", r
        # replaced while it runs: new connections follow at once
        t0 = time.monotonic()
        sbx.update_network({"allow_out": ["other.test"], "deny_out": ["0.0.0.0/0"]})
        assert time.monotonic() - t0 < 1.0
        r = probe(sbx, [["allowed", "http", peer.ip, 80, "allowed.test"],
                        ["other", "http", "other.test", 80, "other.test"]])
        assert r["allowed"].startswith("ok:403") and r["other"] == f"ok:200 {peer.ip} other.test -", r
        # denyOut 0.0.0.0/0 alone: nothing, not even DNS
        sbx.update_network({"deny_out": ["0.0.0.0/0"]})
        r = probe(sbx, [["dns", "resolve", "other.test"], ["http", "http", peer.ip, 80, "other.test"]])
        assert r["dns"].startswith("err:gaierror") and r["http"] == "err:PermissionError:1", r
    finally:
        sbx.kill()


def test_network_errors_name_the_field(e2b_at):
    with pytest.raises(SandboxException, match="network.allowOut.*not a domain name"):
        Sandbox.create("busybox", network={"allow_out": ["bad_name!"]})
    with pytest.raises(SandboxException, match="network.denyOut.*not an IP address"):
        Sandbox.create("busybox", network={"deny_out": ["example.com"]})
    sbx = Sandbox.create("busybox")
    try:
        with pytest.raises(SandboxException, match="network.allowOut"):
            sbx.update_network({"allow_out": ["*.*.test"]})
        r = httpx.put(f"{e2b_at}/sandboxes/{sbx.sandbox_id}/network", headers={"X-API-KEY": sbx.connection_config.api_key},
                      json={"egressProxy": {"address": "1.2.3.4:8080"}})
        assert r.status_code == 400 and "network.egressProxy" in r.text, r.text
    finally:
        sbx.kill()


def test_without_a_domain_get_host_names_a_host_that_fails_clearly(e2b_at):
    """No DSEC_DOMAIN on this server: get_host names a `.invalid` host (it resolves nowhere, and
    the SDK's traffic no longer goes to e2b.app with the sandbox's tokens); a request that reaches
    the server under that name anyway is told what to set."""
    sbx = Sandbox.create("busybox")
    try:
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.dsec-domain-unset.invalid", host
        r = httpx.get(e2b_at.removesuffix("/e2b") + "/", headers={"Host": host, "E2B-Traffic-Access-Token": sbx.traffic_access_token})
        assert r.status_code == 421 and "DSEC_DOMAIN" in r.text, r.text
    finally:
        sbx.kill()


def test_allow_out_names_an_operators_rule_set_with_an_at(e2b_at, peer):
    """E2B's allowOut takes '@name' for an operator's rule set (dsec's own: E2B has none)."""
    key = {"Authorization": f"Bearer {os.environ['E2B_API_KEY']}"}
    base = e2b_at.removesuffix("/e2b")
    r = httpx.put(f"{base}/v1/network/rulesets/e2b-web", headers=key, json={"domains": ["allowed.test"]})
    assert r.status_code == 200, r.text
    sbx = Sandbox.create("debian-python", network={"allow_out": ["@e2b-web"], "deny_out": ["0.0.0.0/0"]})
    try:
        assert sbx.get_info().allow_internet_access is True      # some egress
        r = probe(sbx, [["a", "http", "allowed.test", 80, "allowed.test"], ["o", "http", peer.ip, 80, "other.test"]])
        assert r["a"] == f"ok:200 {peer.ip} allowed.test -" and r["o"].startswith("ok:403"), r
    finally:
        sbx.kill()
        httpx.delete(f"{base}/v1/network/rulesets/e2b-web", headers=key)
    with pytest.raises(SandboxException, match="network.allowOut.*rule set name"):
        Sandbox.create("busybox", network={"allow_out": ["@bad name"]})
