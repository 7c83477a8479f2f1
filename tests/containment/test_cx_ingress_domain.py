"""Issue 25 items 3 and 5 from inside: an E2B sandbox now gets the internet by default (the root
project allows it), and the server listens on a second port (HTTPS for DSEC_DOMAIN). Neither
widens what a sandbox reaches on this host: the apiserver's HTTP and HTTPS ports on every host
address and the bridge gateway stay unreachable, and dsec's CA key is nowhere in the sandbox."""

from __future__ import annotations

import pytest

from dsec.apiserver.e2b.ids import to_dsec

from containment._util import host_ipv4_addresses, py
from containment.test_cx_network import GATEWAY, PROBES

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")
from e2b import Sandbox  # noqa: E402


async def test_default_internet_sandbox_reaches_no_apiserver_port(server, e2b_env):
    https_port = int(server.env["DSEC_HTTPS_PORT"])
    targets = sorted(set(host_ipv4_addresses() + [GATEWAY]))
    sbx = Sandbox.create("debian-python")
    try:
        async with server.client() as c:
            sb = await c.get(to_dsec(sbx.sandbox_id))
            assert any(r.cidr == "0.0.0.0/0" for r in sb.info.network.rules), sb.info.network
            out = await py(sb, PROBES + f"""
for host in {targets!r}:
    for port in ({server.port}, {https_port}):
        OUT[f"{{host}}:{{port}}"] = tcp(host, port, 1.0)[0]
OUT["ca_key"] = os.path.exists({str(server.paths.home / "tls" / "ca.key")!r})
""", user="root", timeout_s=120)
        assert out.pop("ca_key") is False, out           # the host's path of it: not in the sandbox
        assert not any(v.startswith("ok:") for v in out.values()), out
    finally:
        sbx.kill()
