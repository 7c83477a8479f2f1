"""Attacks on egress_proxy (issue 30 item 3) from inside sandboxes: a neighbour that wants a
tunnelled sandbox's SOCKS5 proxy and credentials (its source address taken with IP_FREEBIND,
the SOCKS server dialled directly), and a tunnelled sandbox that wants a direct path."""

from __future__ import annotations

import time

import socks_peer
from containment._util import py
from socks_peer import PASSWORD, probe

xpeer, xserver = socks_peer.xpeer, socks_peer.xserver   # the module's fixtures


async def test_a_sandbox_cannot_use_another_sandboxs_socks_proxy(xserver, xpeer):
    p, socks = xpeer, xpeer.socks
    async with xserver.client() as c:
        holder = await c.create_container(image="debian-python", network={
            "rules": [{"cidr": p.ip}], "egress_proxy": {"address": socks.address, "username": "u1",
                                                          "password": PASSWORD}})
        neighbour = await c.create_container(image="debian-python", network={"rules": [{"cidr": p.ip}]})
        try:
            r = await probe(holder, [["ip80", "http", p.ip, 80, "h.test"]])
            assert r["ip80"].startswith("ok:200"), r
            mine = await py(holder, f"""
import socket
s = socket.create_connection(("{p.ip}", 80), timeout=10)   # TCP: its UDP is denied (tunnelled)
OUT["ip"] = s.getsockname()[0]
""")
            # the proxy logs a connection once its SOCKS handshake is done, which under load can
            # come after the sandbox's command returned: wait for both of the holder's (probe, mine)
            deadline = time.monotonic() + 30
            while len([s for s in socks.seen() if s["user"] == "u1"]) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            u1_before = [s for s in socks.seen() if s["user"] == "u1"]
            assert len(u1_before) == 2, u1_before
            # the neighbour goes direct (no proxy of its own), never through the holder's
            r = await probe(neighbour, [["ip80", "http", p.ip, 80, "n.test"],
                                        ["socks", "tcp", p.ip2, 1080, ""]])
            assert r["ip80"].startswith(f"ok:200 {p.ip} n.test"), r
            assert r["socks"].startswith("err:PermissionError"), r       # the SOCKS server is not its to reach
            # the holder's address as its source (IP_FREEBIND needs no capability): no connection
            out = await py(neighbour, f"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_IP, 15, 1)   # IP_FREEBIND
s.settimeout(5)
OUT["bind"] = attempt(s.bind, ("{mine['ip']}", 0))
OUT["connect"] = attempt(s.connect, ("{p.ip}", 80))
""", timeout_s=60)
            assert out["connect"] != "ok", out
            time.sleep(1)
            after = [s for s in socks.seen() if s["user"] == "u1"]
            assert after == u1_before, (u1_before, after)     # nothing carried with the holder's credentials
            # the holder cannot leave directly either: its policy does not allow the SOCKS server,
            # and a raw connection to the allowed peer is the proxy's, not a direct one
            r = await probe(holder, [["socks", "tcp", p.ip2, 1080, ""]])
            assert r["socks"].startswith("err:PermissionError"), r
        finally:
            await holder.stop()
            await neighbour.stop()
