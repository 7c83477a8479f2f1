"""The stock e2b SDK's per-host header transforms (network={"rules": {host: [{"transform":
{"headers": ...}}]}}) mapped onto dsec's egress secrets (issue 30), and egress_proxy with rules refused
by name. Local peers only (tests/secrets_peer.py)."""

from __future__ import annotations

import json

import pytest

import secrets_peer
from secrets_peer import SECRET, PROBE, digest, headers_of

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")
from e2b import Sandbox  # noqa: E402
from e2b.exceptions import SandboxException  # noqa: E402

speer, sserver = secrets_peer.speer, secrets_peer.sserver   # the module's fixtures


@pytest.fixture(scope="module")
def e2b_at(sserver):
    mp = pytest.MonkeyPatch()
    url = f"{sserver.url}/e2b"
    for k, v in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": sserver.key,
                 "E2B_DOMAIN": "dsec.invalid"}.items():
        mp.setenv(k, v)
    mp.delenv("E2B_DEBUG", raising=False)
    yield url
    mp.undo()


def test_rules_transform_headers_added_outside_the_sandbox(e2b_at, speer):
    sbx = Sandbox.create("debian-python", network={
        "allow_out": ["secret.test", "other.test"], "deny_out": ["0.0.0.0/0"],
        "rules": {"secret.test": [{"transform": {"headers": {"Authorization": f"Bearer {SECRET}"}}}]}})
    try:
        sbx.files.write("/tmp/sprobe.py", PROBE)
        checks = [["with", "https://secret.test/headers", {}],
                  ["other", "https://other.test/headers", {"verify": False}]]
        r = sbx.commands.run(f"python3 /tmp/sprobe.py '{json.dumps(checks)}' /tmp/o.json && cat /tmp/o.json",
                             timeout=120)
        out = json.loads(r.stdout)
        assert headers_of(out["with"]).get("authorization") == digest(f"Bearer {SECRET}"), out
        assert "authorization" not in headers_of(out["other"]), out
        env = sbx.commands.run("cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'", user="root").stdout
        assert SECRET not in env and "SSL_CERT_FILE=" in env
    finally:
        sbx.kill()


def test_egress_proxy_with_rules_is_refused_by_name(e2b_at):
    with pytest.raises(SandboxException) as e:
        Sandbox.create("debian-python", network={
            "allow_out": ["secret.test"], "egress_proxy": {"address": "proxy.example.com:1080"},
            "rules": {"secret.test": [{"transform": {"headers": {"X": "y"}}}]}})
    assert "network.egress_proxy" in str(e.value) and "SOCKS5" in str(e.value)
