"""Attacks on the node's DNS forwarder and egress proxy (issue 25): names that resolve to the
host itself, its loopback, the gateway, link-local metadata or another sandbox must not turn
the proxy into a way in; its ports are reachable only through the redirect."""

from __future__ import annotations

import socket
import threading

from containment._util import py
from egress_peer import probe, sandbox_ip, dserver, peer  # noqa: F401 (fixtures)


class _Listener:
    """A TCP listener on this host that records whoever connects."""

    def __init__(self, ip: str, port: int):
        self.seen: list[str] = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, port))
        self.sock.listen(16)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                c, a = self.sock.accept()
            except OSError:
                return
            self.seen.append(a[0])
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nHOST")
            c.close()

    def close(self) -> None:
        self.sock.close()


async def test_proxy_never_connects_to_the_host_or_other_sandboxes(dserver, peer):
    """Allowed names that resolve to the host's own address, loopback, the gateway, link-local
    metadata or another sandbox: every HTTP/HTTPS attempt fails and no listener sees a connection."""
    listeners = [_Listener(peer.host_ip, 80), _Listener(peer.host_ip, 443)]
    async with dserver.client() as c:
        victim = await c.create_container(image="debian-python", network={"rules": [{"cidr": peer.ip2}]})
        attacker = None
        try:
            await victim.run("nohup python3 -m http.server 80 >/tmp/victim.log 2>&1 &", user="root")
            vip = sandbox_ip(dserver, victim.id)
            gw = vip.rsplit(".", 1)[0] + ".1"
            names = {"host.test": peer.host_ip, "loop.test": "127.0.0.1", "gw.test": gw,
                     "meta.test": "169.254.169.254", "victim.test": vip, "zero.test": "0.0.0.0"}
            peer.set_zone({**names, "allowed.test": peer.ip})
            attacker = await c.create_container(image="debian-python", network={"domains": sorted(names)})
            checks = []
            for name in names:
                checks += [[f"http {name}", "http", peer.ip, 80, name], [f"https {name}", "https", peer.ip, 443, name]]
            r = await probe(attacker, checks)
            leaked = {k: v for k, v in r.items() if not k.endswith(".s") and v.startswith("ok")}
            assert not leaked, leaked
            assert all(not lst.seen for lst in listeners), [lst.seen for lst in listeners]
            log = (await victim.run("cat /tmp/victim.log", user="root")).stdout
            assert "GET" not in log, log
            # the forwarder's and the proxy's own ports, straight at the gateway, from a sandbox
            # whose policy allows every address: dropped (only the redirect reaches them)
            await attacker.set_network(rules=[{"cidr": "0.0.0.0/0"}])
            r = await probe(attacker, [["proxy", "tcp", gw, 10080], ["dns", "tcp", gw, 10053],
                                       ["victim", "tcp", vip, 80]])
            assert all(r[k].startswith("err:") for k in ("proxy", "dns", "victim")), r
        finally:
            for lst in listeners:
                lst.close()
            await victim.stop()
            if attacker is not None:
                await attacker.stop()
            peer.set_zone({"allowed.test": peer.ip, "other.test": peer.ip, "a.wild.test": peer.ip})


async def test_a_deny_all_sandbox_reaches_no_resolver(dserver, peer):
    """No egress: port 53 to the gateway, the peer or anywhere fails at once (EPERM), over UDP and TCP."""
    async with dserver.client() as c:
        sb = await c.create_container(image="debian-python")
        try:
            out = await py(sb, f"""
import socket
for host in ("{peer.ip}", "10.197.0.1", "8.8.8.8"):
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        s = socket.socket(socket.AF_INET, kind)
        s.settimeout(2)
        try:
            s.connect((host, 53))
            s.send(b"x")
            OUT[host + str(kind)] = "sent"
        except OSError as e:
            OUT[host + str(kind)] = e.errno
""")
            assert set(out.values()) == {1}, out   # EPERM
        finally:
            await sb.stop()
