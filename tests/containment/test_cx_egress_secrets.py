"""Attacks on secrets added at the egress proxy (issue 30), from inside sandboxes: the node's CA
key, the bound trust bundle, a neighbour without the secret, and a sandbox that sends the
header itself or a malformed request to have the proxy pass the secret somewhere else."""

from __future__ import annotations

import json

import secrets_peer
from containment._util import py, sh
from secrets_peer import PROBE, SECRET, digest, headers_of

speer, sserver = secrets_peer.speer, secrets_peer.sserver   # the module's fixtures


async def _probe(sb, checks: list) -> dict:
    await sb.files.write("/tmp/sprobe.py", PROBE)
    r = await sh(sb, f"python3 /tmp/sprobe.py '{json.dumps(checks)}' /tmp/sp.json && cat /tmp/sp.json",
                 timeout_s=120)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


async def test_secret_stays_with_its_sandbox_and_the_ca_key_with_the_node(sserver, speer):
    p = speer
    async with sserver.client() as c:
        await c.create_secret("cx", SECRET, ["secret.test"], header="X-Api-Key")
        net = {"rules": [{"cidr": p.ip}, {"cidr": p.ip2}]}
        holder = await c.create_container(image="debian-python", secrets=["cx"], network=net)
        neighbour = await c.create_container(image="debian-python", network=net)
        try:
            # the bound bundle: certificates only, read-only even for root; no key anywhere near
            out = await py(holder, """
import os, glob
OUT["files"] = sorted(glob.glob("/etc/dsec/*"))
OUT["key"] = "PRIVATE KEY" in open("/etc/dsec/egress-ca-bundle.pem").read()
try:
    open("/etc/dsec/egress-ca-bundle.pem", "a").write("x")
    OUT["write"] = "ok"
except OSError as e:
    OUT["write"] = e.errno
""")
            assert out["files"] == ["/etc/dsec/egress-ca-bundle.pem"] and out["key"] is False, out
            assert out["write"] in (13, 30), out          # EACCES / EROFS
            # the sandbox sends the header itself, a folded header, an absolute URI elsewhere
            r = await _probe(holder, [
                ["own", "https://secret.test/headers", {"raw": True, "sni": "secret.test",
                                                          "host": "secret.test\r\nX-Api-Key: mine"}],
                ["folded", "https://secret.test/headers", {"raw": True, "sni": "secret.test",
                                                             "host": "secret.test\r\n X-Evil: 1"}],
                ["absolute", "https://secret.test/http://other.test/headers",
                 {"raw": True, "sni": "secret.test", "host": "secret.test"}],
            ])
            assert headers_of(r["own"]).get("x-api-key") == digest(SECRET), r   # replaced, not appended
            assert r["folded"].startswith("ok:400"), r
            assert digest(SECRET) not in r["absolute"], r
            # a neighbour of the same project without the secret: the destination gets nothing,
            # and its TLS was never terminated (the neighbour does not trust the node's CA)
            r = await _probe(neighbour, [["plain", "https://secret.test/headers", {"verify": False}],
                                         ["verified", "https://secret.test/headers", {}]])
            assert "x-api-key" not in headers_of(r["plain"]), r
            assert "CERTIFICATE_VERIFY_FAILED" in r["verified"], r
            env = (await sh(neighbour, "cat /proc/*/environ | tr '\\0' '\\n'")).stdout
            assert "SSL_CERT_FILE" not in env
        finally:
            await holder.stop()
            await neighbour.stop()
            await c.delete_secret("cx")
