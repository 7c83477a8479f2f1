"""The stock e2b SDK's network.egress_proxy (SOCKS5, issue 30 item 3): the sandbox's TCP goes
through the SOCKS5 server (tests/socks_peer.py) with the credentials given, which never enter
the sandbox; TLS to the proxy refused by name. Local peers only."""

from __future__ import annotations

import json

import pytest

import socks_peer
from socks_peer import PASSWORD, PROBE

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")
from e2b import Sandbox  # noqa: E402
from e2b.exceptions import SandboxException  # noqa: E402

xpeer, xserver = socks_peer.xpeer, socks_peer.xserver   # the module's fixtures


@pytest.fixture(scope="module")
def e2b_socks(xserver):
    mp = pytest.MonkeyPatch()
    url = f"{xserver.url}/e2b"
    for k, v in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": xserver.key,
                 "E2B_DOMAIN": "dsec.invalid"}.items():
        mp.setenv(k, v)
    mp.delenv("E2B_DEBUG", raising=False)
    yield url
    mp.undo()


def test_stock_sdk_sandbox_tunnelled_through_socks5(e2b_socks, xpeer):
    p, socks = xpeer, xpeer.socks
    pw = PASSWORD + "-2"
    sbx = Sandbox.create("debian-python", network={
        "allow_out": [p.ip, "allowed.test"], "deny_out": ["0.0.0.0/0"],
        "egress_proxy": {"address": socks.address, "username": "u2", "password": pw}})
    try:
        sbx.files.write("/tmp/xprobe.py", PROBE)
        checks = [["ip80", "http", p.ip, 80, "e2b.test"], ["name443", "https", "allowed.test", 443, "allowed.test"]]
        out = json.loads(sbx.commands.run(f"python3 /tmp/xprobe.py '{json.dumps(checks)}'", timeout=120).stdout)
        assert out["ip80"].startswith(f"ok:200 {p.ip} e2b.test"), out
        assert out["name443"].startswith(f"ok:200 {p.ip} allowed.test"), out
        seen = socks.seen()
        assert {"user": "u2", "target": p.ip, "port": 80} in seen, seen
        assert {"user": "u2", "target": p.ip, "port": 443} in seen, seen   # the CIDR rule decided: by address
        env = sbx.commands.run("cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'", user="root").stdout
        assert "PATH=" in env and pw not in env
        # an update that omits the proxy keeps tunnelling (never direct); another proxy is refused
        sbx.update_network({"allow_out": [p.ip], "deny_out": ["0.0.0.0/0"]})
        out = json.loads(sbx.commands.run(f"python3 /tmp/xprobe.py '{json.dumps(checks[:1])}'", timeout=120).stdout)
        assert out["ip80"].startswith("ok:200"), out
        assert len([s for s in socks.seen() if s["user"] == "u2" and s["port"] == 80]) >= 2
        with pytest.raises(SandboxException, match="network.egressProxy"):
            sbx.update_network({"allow_out": [p.ip], "egress_proxy": {"address": "10.9.9.9:1080"}})
    finally:
        sbx.kill()
    with pytest.raises(SandboxException, match="network.egressProxy.tls"):
        Sandbox.create("debian-python", network={"egress_proxy": {"address": socks.address, "tls": True}})
