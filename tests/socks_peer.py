"""A SOCKS5 server for the egress_proxy tests (issue 30 item 3), in the egress peer's network
namespace (tests/egress_peer.py): RFC 1928 CONNECT, RFC 1929 username/password when started
with credentials; every CONNECT is recorded (user, target, port) as a JSON line before it is
dialled. Names are resolved from the peer's zone file. Nothing leaves the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from egress_peer import READ_ALL, egress_peer, side_server

PASSWORD = "socks-pw-" + "7f3a9c1e5b"
SOCKS_PORT = 1080

SOCKS_SERVER = r"""
import asyncio, json, socket, struct, sys
port, log_path, zone_path, users = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])

async def pipe(r, w):
    try:
        while True:
            d = await r.read(65536)
            if not d:
                break
            w.write(d)
            await w.drain()
        w.write_eof()
    except Exception:
        w.close()

async def serve(r, w):
    try:
        ver, n = await r.readexactly(2)
        methods = await r.readexactly(n)
        user = None
        if users:
            if 2 not in methods:
                w.write(b"\x05\xff"); await w.drain(); return
            w.write(b"\x05\x02"); await w.drain()
            await r.readexactly(1)
            user = (await r.readexactly((await r.readexactly(1))[0])).decode()
            pw = (await r.readexactly((await r.readexactly(1))[0])).decode()
            if users.get(user) != pw:
                w.write(b"\x01\x01"); await w.drain(); return
            w.write(b"\x01\x00")
        else:
            w.write(b"\x05\x00")
        _, cmd, _, atyp = await r.readexactly(4)
        if atyp == 1:
            host = socket.inet_ntoa(await r.readexactly(4))
        elif atyp == 3:
            host = (await r.readexactly((await r.readexactly(1))[0])).decode()
        else:
            w.write(b"\x05\x08\x00\x01" + bytes(6)); return
        dport = struct.unpack(">H", await r.readexactly(2))[0]
        with open(log_path, "a") as f:
            f.write(json.dumps({"user": user, "target": host, "port": dport}) + "\n")
        addr = json.load(open(zone_path)).get(host, host)
        try:
            ur, uw = await asyncio.open_connection(addr, dport)
        except OSError:
            w.write(b"\x05\x05\x00\x01" + bytes(6)); await w.drain(); return
        w.write(b"\x05\x00\x00\x01" + bytes(6))
        await asyncio.gather(pipe(r, uw), pipe(ur, w))
    except Exception:
        pass
    finally:
        w.close()

async def main():
    srv = await asyncio.start_server(serve, "0.0.0.0", port)
    print("ready", flush=True)
    await srv.serve_forever()
asyncio.run(main())
"""


class Socks:
    """The SOCKS5 server in the peer's namespace; start()/stop() for the fail-closed checks."""

    def __init__(self, peer, log: Path, users: dict[str, str]) -> None:
        self.peer, self.log, self.users = peer, log, users
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.peer.ip2}:{SOCKS_PORT}"   # ip2: an address the sandboxes' policies do not allow

    def start(self) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.peer.ns, sys.executable, "-c", SOCKS_SERVER,
                                      str(SOCKS_PORT), str(self.log), str(self.peer.zone), json.dumps(self.users)],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == b"ready"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def seen(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def xpeer(tmp_path_factory):
    """The egress peer (allowed.test, other.test -> its first address) and a SOCKS5 server on its
    second address taking users u1 and u2."""
    from conftest import requires_root
    requires_root()
    d = tmp_path_factory.mktemp("socks-peer")
    with egress_peer(d) as p:
        p.set_zone({"allowed.test": p.ip, "other.test": p.ip})
        socks = Socks(p, d / "connects.jsonl", {"u1": PASSWORD, "u2": PASSWORD + "-2"})
        socks.start()
        p.socks = socks
        try:
            yield p
        finally:
            socks.stop()


@pytest.fixture(scope="module")
def xserver(images, dsec_home, tmp_path_factory, xpeer):
    with side_server(dsec_home, tmp_path_factory, "socks", xpeer) as srv:
        yield srv


# Run in a sandbox: argv[1] a JSON list of [name, kind, host, port, extra]; kind http (extra: Host),
# https (extra: SNI, no verification), tcp (connect only) or udp (one datagram); prints {name: "ok:..." | "err:..."}.
PROBE = READ_ALL + r'''
import json, socket, ssl, sys
def one(kind, host, port, extra):
    try:
        if kind == "udp":
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.sendto(b"x", (host, port))
            return "ok:sent"
        s = socket.create_connection((host, port), timeout=8)
        if kind == "tcp":
            s.settimeout(3)
            try:
                d = s.recv(1)
            except socket.timeout:
                return "ok:open"
            return "ok:open" if d else "err:closed"
        if kind == "https":
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            s = ctx.wrap_socket(s, server_hostname=extra)
        s.sendall(("GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % extra).encode())
        data = read_all(s)
        if not data:
            return "err:closed"
        return "ok:" + data.split(b" ", 2)[1].decode() + " " + data.split(b"\r\n\r\n", 1)[1].decode().strip()
    except (OSError, ssl.SSLError) as e:
        return "err:" + type(e).__name__ + ":" + str(getattr(e, "errno", "") or e)[:80]
print(json.dumps({n: one(k, h, p, x) for n, k, h, p, x in json.loads(sys.argv[1])}))
'''


async def probe(sb, checks: list) -> dict:
    await sb.files.write("/tmp/xprobe.py", PROBE)
    r = await sb.run(f"python3 /tmp/xprobe.py '{json.dumps(checks)}'", timeout_s=120)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)
