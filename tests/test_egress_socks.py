"""E2B's egress_proxy (issue 30 item 3) natively: NetworkPolicy.egress_proxy carries all of a
sandbox's TCP through a SOCKS5 server (tests/socks_peer.py, in a peer's network namespace), by
address where the CIDR rules decided, by name where the domain rules did; fail-closed; the
proxy's credentials never inside."""

from __future__ import annotations

import signal
import time

import httpx

import socks_peer
from socks_peer import PASSWORD, probe

xpeer, xserver = socks_peer.xpeer, socks_peer.xserver   # the module's fixtures


def _alive(srv) -> bool:
    try:
        return httpx.get(f"{srv.url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_seen(socks, pred, timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        seen = socks.seen()
        if pred(seen) or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


async def test_all_tcp_goes_through_socks_and_fails_closed(xserver, xpeer):
    p, socks = xpeer, xpeer.socks
    async with xserver.client() as c:
        sb = await c.create_container(image="debian-python", network={
            "rules": [{"cidr": p.ip, "ports": [80, 9000]}], "domains": ["allowed.test"],
            "egress_proxy": {"address": socks.address, "username": "u1", "password": PASSWORD}})
        try:
            r = await probe(sb, [
                ["ip80", "http", p.ip, 80, "x.test"],             # by address: the CIDR rule
                ["name443", "https", "allowed.test", 443, "allowed.test"],   # by name: the domain rule
                ["port9000", "tcp", p.ip, 9000, ""],              # any port the policy allows
                ["other", "https", "other.test", 443, "other.test"],         # not allowed: never asked
                ["socks_direct", "tcp", p.ip2, 1080, ""],         # the SOCKS server itself: not the sandbox's
                ["udp9000", "udp", p.ip, 9000, ""],               # the rule's UDP: not tunnelled, so denied
                ["dns", "http", "allowed.test", 80, "allowed.test"],   # DNS as without a proxy (names resolve)
            ])
            assert r["ip80"].startswith(f"ok:200 {p.ip} x.test"), r
            assert r["name443"].startswith(f"ok:200 {p.ip} allowed.test allowed.test"), r
            assert r["port9000"] == "err:closed", r       # the SOCKS server had nothing there to reach
            assert r["other"].startswith("err:"), r
            assert r["socks_direct"].startswith("err:PermissionError"), r
            assert r["udp9000"].startswith("err:PermissionError"), r
            assert r["dns"].startswith(f"ok:200 {p.ip} allowed.test"), r
            seen = _wait_seen(socks, lambda s: len(s) >= 3)
            assert {"user": "u1", "target": p.ip, "port": 80} in seen, seen
            assert {"user": "u1", "target": "allowed.test", "port": 443} in seen, seen   # by name
            assert {"user": "u1", "target": p.ip, "port": 9000} in seen, seen
            assert not [s for s in seen if s["target"] in ("other.test", p.ip2)], seen
            # the credentials: not in the environment, the files or the sandbox's info
            env = (await sb.run("cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'", user="root")).stdout
            files = (await sb.run(f"grep -rl '{PASSWORD}' /etc /tmp /run /home /root /work /var 2>/dev/null; true",
                                  user="root")).stdout
            assert "PATH=" in env and PASSWORD not in env and files.strip() == "", (env, files)
            async with httpx.AsyncClient(base_url=xserver.url,
                                         headers={"Authorization": f"Bearer {xserver.key}"}) as h:
                body = (await h.get(f"/v1/sandboxes/{sb.id}")).text
                assert PASSWORD not in body and socks.address in body, body
                # a later set_network keeps the tunnel; naming another proxy is refused by name
                r2 = await h.put(f"/v1/sandboxes/{sb.id}/network", json={"rules": [{"cidr": p.ip}]})
                assert r2.status_code == 200, r2.text
                r2 = await h.put(f"/v1/sandboxes/{sb.id}/network", json={
                    "rules": [{"cidr": p.ip}], "egress_proxy": {"address": "10.1.2.3:1080"}})
                assert r2.status_code == 422 and "egress_proxy" in r2.text, r2.text
            before = len(socks.seen())
            r = await probe(sb, [["ip80", "http", p.ip, 80, "y.test"]])
            assert r["ip80"].startswith(f"ok:200 {p.ip} y.test"), r
            assert len(_wait_seen(socks, lambda s: len(s) > before)) > before
            # fail-closed: the SOCKS server down, the policy allows p.ip directly, yet nothing goes
            socks.stop()
            try:
                r = await probe(sb, [["ip80", "http", p.ip, 80, "z.test"],
                                     ["name443", "https", "allowed.test", 443, "allowed.test"]])
                assert r["ip80"] == "err:closed" and r["name443"].startswith("err:"), r
            finally:
                socks.start()
        finally:
            await sb.stop()


async def test_wrong_credentials_or_none_fail_closed(xserver, xpeer):
    p, socks = xpeer, xpeer.socks
    async with xserver.client() as c:
        bad = await c.create_container(image="debian-python", network={
            "rules": [{"cidr": p.ip}], "egress_proxy": {"address": socks.address, "username": "u1",
                                                          "password": "wrong"}})
        anon = await c.create_container(image="debian-python", network={
            "rules": [{"cidr": p.ip}], "egress_proxy": {"address": socks.address}})
        try:
            for sb in (bad, anon):
                r = await probe(sb, [["ip80", "http", p.ip, 80, "w.test"]])
                assert r["ip80"] == "err:closed", r
            assert not [s for s in socks.seen() if s["target"] == p.ip and s["port"] == 80 and s["user"] != "u1"]
        finally:
            await bad.stop()
            await anon.stop()


async def test_still_tunnelled_after_the_edge_is_killed(xserver, xpeer):
    """kill -9 of the server: the restarted edge rebuilds the tunnel set from its SQLite, so the
    sandbox never goes direct; the credentials were in memory only, so this proxy (which needs
    them) now refuses: the connection is accepted by the node proxy and closed, though the
    policy allows the peer directly."""
    p, socks = xpeer, xpeer.socks
    async with xserver.client() as c:
        sb = await c.create_container(image="debian-python", network={
            "rules": [{"cidr": p.ip}], "egress_proxy": {"address": socks.address, "username": "u1",
                                                          "password": PASSWORD}})
        r = await probe(sb, [["ip80", "http", p.ip, 80, "k.test"]])
        assert r["ip80"].startswith("ok:200"), r
    try:
        xserver.kill(signal.SIGKILL)
        xserver.start()
        async with xserver.client() as c:
            sb = await c.get(sb.id)
            try:
                r = await probe(sb, [["ip80", "http", p.ip, 80, "k2.test"]])
                assert r["ip80"] == "err:closed", r
            finally:
                await sb.stop()
    finally:
        if not _alive(xserver):   # the module's fixture outlives this test
            xserver.start()
