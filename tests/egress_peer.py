"""Test peers for DNS and egress by name, all on this machine (nothing leaves the box).

`egress_peer()`: a network namespace routed from the host (10.198.N.0/24) holding
- a DNS server (dnslib) on .2:53, UDP and TCP, answering A records from a JSON zone file the
  test may rewrite (re-read per query), NXDOMAIN otherwise;
- HTTP on :80 and HTTPS on :443 (a self-signed certificate) on .2 and .3, answering
  "<local address> <Host header> <SNI>" so a test sees which server and name it reached.
`side_server()`: a dsec server of its own (a side home) on its own bridge and subnet, its DNS
forwarder's upstream pointed at the peer's DNS server.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

PEER_SERVER = r"""
import hashlib, json, socket, ssl, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from dnslib import A, QTYPE, RCODE, RR
from dnslib.server import BaseResolver, DNSServer

zone_path, cert, key = sys.argv[1:4]
# optional: {sni: [cert, key]}: certificates served by SNI (tests/test_egress_secrets.py)
by_sni = json.load(open(sys.argv[4])) if len(sys.argv) > 4 else {}

class Zone(BaseResolver):
    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".").lower()
        zone = json.load(open(zone_path))
        if name not in zone:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(zone[name]), ttl=30))
        return reply

for tcp in (False, True):
    DNSServer(Zone(), address="0.0.0.0", port=53, tcp=tcp).start_thread()

class Echo(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/headers"):   # what arrived: the secrets tests look for added ones
            # digests, not values: the client (a sandbox) must never receive a secret back
            body = json.dumps({k.lower(): hashlib.sha256(v.encode()).hexdigest()
                               for k, v in self.headers.items()}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.split("=", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path == "/big":            # 64 MiB: the throughput benchmark
            self.send_response(200)
            self.send_header("Content-Length", str(64 << 20))
            self.end_headers()
            chunk = b"x" * (1 << 20)
            for _ in range(64):
                self.wfile.write(chunk)
            return
        sni = getattr(self.connection, "dsec_sni", "-")
        body = ("%s %s %s\n" % (self.connection.getsockname()[0], self.headers.get("Host"), sni)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass

class TLSServer(ThreadingHTTPServer):
    def get_request(self):
        sock, addr = super().get_request()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        seen = {}
        def pick(s, name, c):
            seen["sni"] = name
            if name in by_sni:
                other = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                other.load_cert_chain(*by_sni[name])
                s.context = other
        ctx.sni_callback = pick
        sock.settimeout(5)
        tls = ctx.wrap_socket(sock, server_side=True)
        tls.dsec_sni = seen.get("sni") or "-"
        return tls, addr

http = ThreadingHTTPServer(("0.0.0.0", 80), Echo)
https = TLSServer(("0.0.0.0", 443), Echo)
for srv in (http, https):
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@dataclass
class EgressPeer:
    ns: str
    host_ip: str      # the host's end of the veth (an address of this host)
    ip: str           # DNS, HTTP, HTTPS
    ip2: str          # HTTP, HTTPS: "another server" no name points at
    zone: Path

    def set_zone(self, names: dict[str, str]) -> None:
        tmp = self.zone.with_suffix(".tmp")
        tmp.write_text(json.dumps(names))
        tmp.replace(self.zone)


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@contextmanager
def egress_peer(tmp: Path, certs_by_sni: dict[str, tuple[str, str]] | None = None):
    tag = os.getpid() % 100000
    n = 20 + os.getpid() % 200
    ns, hveth = f"dsecp{tag}", f"dsph{tag}"
    zone = tmp / "zone.json"
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    _sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=allowed.test", "-days", "2",
        "-keyout", str(key), "-out", str(cert))
    peer = EgressPeer(ns, f"10.198.{n}.1", f"10.198.{n}.2", f"10.198.{n}.3", zone)
    peer.set_zone({})
    proc = None
    extra = []
    if certs_by_sni:
        (tmp / "by_sni.json").write_text(json.dumps(certs_by_sni))
        extra = [str(tmp / "by_sni.json")]
    _sh("ip", "netns", "add", ns)
    try:
        _sh("ip", "link", "add", hveth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "addr", "add", f"{peer.host_ip}/24", "dev", hveth)
        _sh("ip", "link", "set", hveth, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{peer.ip}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "addr", "add", f"{peer.ip2}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "route", "add", "default", "via", peer.host_ip)
        Path(f"/proc/sys/net/ipv4/conf/{hveth}/forwarding").write_text("1")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", PEER_SERVER, str(zone),
                                 str(cert), str(key), *extra], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield peer
    finally:
        if proc:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", hveth], capture_output=True)


def side_server_env(peer: EgressPeer) -> dict[str, str]:
    """A bridge and subnet of this test process's own, so that concurrent test servers on the
    host (which use dsec0) never share it; the forwarder asks the peer's DNS server."""
    tag = os.getpid() % 100000
    return {"DSEC_NET_BRIDGE": f"dsd{tag}", "DSEC_NET_SUBNET": f"10.197.{os.getpid() % 250}.0/24",
            "DSEC_NET_DNS_UPSTREAM": f"{peer.ip}:53"}


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """The peer with names: allowed.test, other.test, a.wild.test, wild.test -> its first address."""
    from conftest import requires_root
    requires_root()
    with egress_peer(tmp_path_factory.mktemp("egress-peer")) as p:
        p.set_zone({"allowed.test": p.ip, "other.test": p.ip, "a.wild.test": p.ip, "wild.test": p.ip})
        yield p


@contextmanager
def side_server(dsec_home, tmp_path_factory, name: str, peer: EgressPeer, vm: bool = False, **env: str):
    """A dsec server of its own home on a bridge of its own (side_server_env) whose DNS
    forwarder asks the peer; `env` adds settings; `vm`: with the node's guest kernel (VM
    backends). Stopped and its home cleaned after."""
    from conftest import side_server as conftest_side_server
    with conftest_side_server(dsec_home, tmp_path_factory, name, {**side_server_env(peer), **env}, downloads=vm) as srv:
        yield srv


@pytest.fixture(scope="module")
def dserver(images, dsec_home, tmp_path_factory, peer):
    """A dsec server on a bridge of its own whose DNS forwarder asks the peer."""
    with side_server(dsec_home, tmp_path_factory, "egress", peer) as srv:
        yield srv


# The in-sandbox probe scripts' read of a whole raw-HTTP answer (until the peer closes), put at
# the top of each of them (PROBE = READ_ALL + ...): egress, socks, secrets, the apt cache's.
READ_ALL = r'''
def read_all(s, n=65536):
    data = b""
    while True:
        c = s.recv(n)
        if not c:
            return data
        data += c
'''

# A probe run inside sandboxes (python3 of debian-python): argv[1] is a JSON list of
# [name, kind, *args]; prints {name: "ok:<data>" | "err:<what>"}.
PROBE = READ_ALL + r'''
import json, socket, ssl, struct, sys, time
def _e(e):
    return "err:" + (type(e).__name__ + ":" + str(getattr(e, "errno", "") or e))[:120]
def resolve(name):
    try:
        return "ok:" + ",".join(sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET)}))
    except OSError as e:
        return _e(e)
def http(host, port, hostheader):
    try:
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(("GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % hostheader).encode())
        data = read_all(s)
        s.close()
        if not data:
            return "err:closed"
        status = data.split(b"\r\n", 1)[0].decode()
        return "ok:" + status.split(" ", 2)[1] + " " + data.split(b"\r\n\r\n", 1)[1].decode().strip()
    except OSError as e:
        return _e(e)
def https(host, port, sni):
    try:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        raw = socket.create_connection((host, port), timeout=5)
        s = ctx.wrap_socket(raw, server_hostname=sni or None)
        s.sendall(("GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % sni).encode())
        data = read_all(s)
        return "ok:" + data.split(b"\r\n\r\n", 1)[1].decode().strip()
    except (OSError, ssl.SSLError) as e:
        return _e(e)
def dns(server, name, tcp, qtype=1):
    q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack(">HH", qtype, 1)
    try:
        if tcp:
            s = socket.create_connection((server, 53), timeout=4)
            s.sendall(struct.pack(">H", len(q)) + q)
            head = s.recv(2)
            if len(head) < 2:
                return "err:closed"
            n = struct.unpack(">H", head)[0]
            r = b""
            while len(r) < n:
                r += s.recv(n - len(r))
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(4)
            s.sendto(q, (server, 53))
            r = s.recv(4096)
        rcode = r[3] & 0xF
        ancount = struct.unpack(">H", r[6:8])[0]
        return "ok:rcode=%d an=%d" % (rcode, ancount)
    except OSError as e:
        return _e(e)
def tcp6(host, port):
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.settimeout(3)
        s.connect((host, port))
        return "ok:connected"
    except OSError as e:
        return _e(e)
def tcp(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "ok:connected"
    except OSError as e:
        return _e(e)
out = {}
for name, kind, *args in json.loads(sys.argv[1]):
    t = time.monotonic()
    out[name] = globals()[kind](*args)
    out[name + ".s"] = round(time.monotonic() - t, 2)
print(json.dumps(out))
'''


async def probe(sb, checks: list[list], timeout_s: float = 240) -> dict:
    """Run PROBE's checks inside the sandbox as root; its JSON answer."""
    await sb.files.write("/tmp/eprobe.py", PROBE)
    r = await sb.run(f"python3 /tmp/eprobe.py '{json.dumps(checks)}'", user="root", timeout_s=timeout_s)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def sandbox_ip(server, sandbox_id: str) -> str:
    """The sandbox's address on the node's bridge, from the edge's own record."""
    with sqlite3.connect(server.paths.edge_db) as db:
        return db.execute("SELECT ip FROM net_sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()[0]
