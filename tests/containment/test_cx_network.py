"""Network attacks. Targets are only: the sandbox's own loopback, this host's own addresses
(incl. the bridge gateway), listeners this module opens on the host, and 169.254.169.254 for the
metadata check (which must be refused by the policy before any packet exists). Every probe is
bounded (few ports, short timeouts)."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from pathlib import Path

import pytest

from dsec.backends.container.network import NetSettings, veth_name
from dsec.sdk.client import Sandbox

from containment._util import DENIED, host_ipv4_addresses, pids_by_sandbox, py

GATEWAY = str(NetSettings().gateway)          # the bridge address of a server with default settings
METADATA = "169.254.169.254"
HAS_SET_NETWORK = hasattr(Sandbox, "set_network")

PROBES = r'''
def tcp(host, port, timeout=1.5):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(timeout)
    t = time.monotonic()
    try:
        s.connect((host, port))
        try:
            s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            data = s.recv(200).decode(errors="replace")
        except OSError:
            data = ""
        return "ok:" + data, time.monotonic() - t
    except socket.timeout:
        return "TIMEOUT", time.monotonic() - t
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno)), time.monotonic() - t
    finally:
        s.close()
def udp(host, port, payload):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(0.5)
    try:
        s.sendto(payload, (host, port))
        return "sent"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    finally:
        s.close()
def dns_query(name):
    import struct
    q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\0" + struct.pack(">HH", 1, 1)
'''


class UdpSink:
    """A UDP listener on the host (all addresses) that records what arrives."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.got: list[bytes] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.got.append(self.sock.recvfrom(4096)[0])
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self._t.join()
        self.sock.close()


class TcpSink:
    """A TCP listener on the host (all addresses) that counts connections: a stand-in for any
    host service (an edge or apiserver bound to a node address)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
                self.accepted += 1
                c.close()
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self._t.join()
        self.sock.close()


def _host_targets() -> list[str]:
    addrs = host_ipv4_addresses()
    if GATEWAY not in addrs:
        addrs.append(GATEWAY)
    return addrs


async def test_apiserver_and_edge_unreachable(attacker, server):
    """Connecting to the apiserver/edge (its port on 127.0.0.1, ::1, every host address and the bridge gateway) reaches nothing: loopback is the sandbox's own (refused), host addresses are denied at connect (EPERM, at once)."""
    targets = _host_targets()
    tcp_sink = TcpSink()
    try:
        out = await py(attacker, PROBES + f"""
for port in ({server.port}, {tcp_sink.port}):
    for host in ["127.0.0.1", "::1"] + {targets!r}:
        OUT[f"{{host}}:{{port}}"] = tcp(host, port)
""", user=None)
    finally:
        tcp_sink.close()
    for key, (res, secs) in out.items():
        if key.startswith(("127.0.0.1:", "::1:")):
            assert res in ("ECONNREFUSED", "EADDRNOTAVAIL", "ENETUNREACH"), (key, res)
        else:
            assert res == "EPERM" and secs < 0.5, (key, res, secs)
    assert tcp_sink.accepted == 0


async def test_metadata_service_denied_without_sending(attacker):
    """Connecting to the cloud metadata address 169.254.169.254 (TCP 80/443, UDP, TCP Fast Open) is refused by the policy at once (EPERM): nothing is sent."""
    out = await py(attacker, PROBES + f"""
OUT["tcp80"] = tcp("{METADATA}", 80)
OUT["tcp443"] = tcp("{METADATA}", 443)
OUT["udp"] = (udp("{METADATA}", 80, b"GET /latest/meta-data/"), 0)
s = socket.socket()
OUT["tfo"] = (attempt(s.sendto, b"GET / HTTP/1.0\\r\\n\\r\\n", socket.MSG_FASTOPEN, ("{METADATA}", 80)), 0)
OUT["v4mapped"] = tcp("::ffff:{METADATA}", 80)          # the same address through an IPv6 socket
""", user="root")
    for key, (res, secs) in out.items():
        assert res == "EPERM" and secs < 0.5, (key, res, secs)


async def test_host_abstract_unix_socket_unreachable(attacker):
    """Connecting to an abstract unix socket the host listens on (the containerd-shim class of escape) fails: abstract names are per network namespace."""
    name = b"\0dsec-cx-" + secrets.token_hex(6).encode()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(name)
    srv.listen(4)
    srv.settimeout(0.2)
    try:
        out = await py(attacker, f"""
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
OUT["connect"] = attempt(s.connect, {name!r})
OUT["listed"] = {name[1:].decode()!r} in read("/proc/net/unix")
""", user="root")
        try:
            srv.accept()
            accepted = True
        except OSError:
            accepted = False
    finally:
        srv.close()
    assert out == {"connect": "ECONNREFUSED", "listed": False} and not accepted, out


async def test_port_scan_loopback_and_gateway(attacker, server):
    """A port scan (1-1024 and the apiserver's port) of 127.0.0.1 finds only the sandbox's own loopback (all refused); of the host's bridge gateway every connect is refused by the policy (EPERM), quickly."""
    out = await py(attacker, f"""
ports = list(range(1, 1025)) + [{server.port}]
res = {{}}
t = time.monotonic()
for host in ("127.0.0.1", "{GATEWAY}"):
    for port in ports:
        s = socket.socket()
        s.settimeout(0.3)
        r = attempt(s.connect, (host, port))
        s.close()
        res.setdefault(host, {{}}).setdefault(r, 0)
        res[host][r] += 1
OUT["res"] = res
OUT["secs"] = time.monotonic() - t
""", user=None)
    n = 1025
    assert out["res"]["127.0.0.1"] == {"ECONNREFUSED": n}, out["res"]
    assert out["res"][GATEWAY] == {"EPERM": n}, out["res"]
    assert out["secs"] < 10, out["secs"]


async def test_dns_exfiltration_when_network_denied(attacker):
    """DNS exfiltration from a deny-all sandbox (UDP and TCP port 53, connected and unconnected UDP, to the host's addresses and the gateway) fails with EPERM and nothing reaches a listener on the host."""
    sink = UdpSink()
    token = secrets.token_hex(6)
    try:
        out = await py(attacker, PROBES + f"""
q = dns_query("{token}.exfil.example")
for host in {_host_targets()!r}:
    for port in (53, {sink.port}):
        OUT[f"udp {{host}}:{{port}}"] = udp(host, port, q)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        OUT[f"udp-connect {{host}}:{{port}}"] = attempt(s.connect, (host, port))
        OUT[f"tcp {{host}}:{{port}}"] = tcp(host, port)[0]
""", user="root")
        time.sleep(0.3)
    finally:
        sink.close()
    assert set(out.values()) == {"EPERM"}, out
    assert sink.got == [], sink.got


async def test_network_configuration_and_raw_sockets(attacker):
    """Changing the sandbox's network (links, addresses, routes, SO_MARK) or opening raw/packet sockets to forge traffic fails (no CAP_NET_ADMIN/NET_RAW, policy's sock_create)."""
    r = await attacker.run("for c in 'ip link add d0 type dummy' 'ip addr add 10.9.9.9/32 dev lo' "
                           "'ip route add 10.9.9.0/24 dev lo' 'ip link set lo down'; do "
                           "$c >/dev/null 2>&1; echo rc=$?; done", user="root")
    # `ip` may be missing in the image (rc=127); either way nothing may succeed
    assert "rc=0" not in r.stdout, r
    out = await py(attacker, """
OUT["raw_icmp"] = attempt(socket.socket, socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
OUT["raw_tcp"] = attempt(socket.socket, socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
OUT["raw6"] = attempt(socket.socket, socket.AF_INET6, socket.SOCK_RAW, 58)
OUT["packet"] = attempt(socket.socket, socket.AF_PACKET, socket.SOCK_RAW, 0)
s = socket.socket()
OUT["so_mark"] = attempt(s.setsockopt, socket.SOL_SOCKET, 36, 1)
import fcntl, struct
OUT["siocsifflags"] = attempt(fcntl.ioctl, s.fileno(), 0x8914, struct.pack("16sH", b"lo", 0) + b"\\0" * 22)
""", user="root")
    assert all(v in DENIED for v in out.values()), out


async def test_vsock_socket_refused(attacker):
    """Opening an AF_VSOCK socket (a channel to the hypervisor that no cgroup-BPF network policy sees) fails for root and the user; nothing is ever connected."""
    for user in ("root", None):
        out = await py(attacker, """
OUT["stream"] = attempt(socket.socket, 40, socket.SOCK_STREAM, 0)
OUT["dgram"] = attempt(socket.socket, 40, socket.SOCK_DGRAM, 0)
OUT["seqpacket"] = attempt(socket.socket, 40, socket.SOCK_SEQPACKET, 0)
""", user=user)
        assert all(v in DENIED + ("EAFNOSUPPORT",) for v in out.values()), (user, out)


# -- a sandbox that is plugged into a bridge: a private server with its own bridge/subnet --------


@pytest.fixture(scope="module")
def netserver(images, dsec_home, tmp_path_factory):
    """A second server with its own bridge and subnet, so plugging sandboxes in cannot disturb
    other dsec instances on this host (they all default to dsec0 / 10.88.0.0/16)."""
    from conftest import LOCAL_DNS_SINK, side_server
    n = 100 + os.getpid() % 100
    with side_server(dsec_home, tmp_path_factory, "cxnet", {"DSEC_NET_BRIDGE": f"dsecx{n}",
                                                            "DSEC_NET_SUBNET": f"10.201.{n}.0/24",
                                                            "DSEC_NET_DNS_UPSTREAM": LOCAL_DNS_SINK}) as srv:
        srv.gateway = f"10.201.{n}.1"
        yield srv


@pytest.mark.xfail(not HAS_SET_NETWORK, reason="Sandbox.set_network (network policy API) is not implemented yet",
                   strict=False)
async def test_policy_changed_live_still_blocks_dns_metadata_and_host(netserver):
    """With set_network() an allow-list (one TCP port elsewhere), then allow-all, then deny-all again: metadata stays denied while not allowed, DNS reaches only the node's forwarder (never a host listener), host services stay unreachable even under allow-all, and nothing reaches the host's listeners."""
    udp_sink, tcp_sink = UdpSink(), TcpSink()
    targets = host_ipv4_addresses() + [netserver.gateway]
    try:
        async with netserver.client() as c:
            sb = await c.create_container(image="debian-python")
            try:
                # TEST-NET-2 address, never contacted: only to plug the sandbox in
                await sb.set_network(rules=[{"cidr": "198.51.100.7/32", "ports": [443], "protocol": "tcp"}])
                probe = PROBES + f"""
for host in {targets!r}:
    OUT["dns " + host] = udp(host, 53, dns_query("leak.example"))
    OUT["udp " + host] = udp(host, {udp_sink.port}, b"leak")
    OUT["tcp " + host] = tcp(host, {tcp_sink.port}, 1.0)[0]
OUT["metadata"] = tcp("{METADATA}", 80)[0]
OUT["links"] = sorted(os.listdir("/sys/class/net"))
"""
                out = await py(sb, probe, user="root")
                assert "eth0" in out.pop("links"), "the sandbox was not plugged in"
                dns = {k: out.pop(k) for k in list(out) if k.startswith("dns ")}
                assert set(dns.values()) == {"sent"}, dns   # to the forwarder (egress is on), see udp_sink
                assert set(out.values()) == {"EPERM"}, out
                # allow-all: the policy lets packets out, but the host itself stays unreachable
                await sb.set_network(rules=[{"cidr": "0.0.0.0/0"}])
                out = await py(sb, PROBES + f"""
for host in {targets!r}:
    OUT["tcp " + host] = tcp(host, {tcp_sink.port}, 1.0)[0]
    OUT["udp " + host] = udp(host, {udp_sink.port}, b"leak-allow-all")
""", user="root")
                assert not any(v.startswith("ok:") for k, v in out.items() if k.startswith("tcp")), out
                # deny-all again: immediate EPERM
                await sb.set_network()
                out = await py(sb, probe, user="root")
                out.pop("links")
                assert set(out.values()) == {"EPERM"}, out
                sid = sb.id
            finally:
                await sb.stop()
            time.sleep(0.3)
    finally:
        udp_sink.close()
        tcp_sink.close()
    assert tcp_sink.accepted == 0 and udp_sink.got == [], (tcp_sink.accepted, udp_sink.got)
    for _ in range(40):
        if sid not in pids_by_sandbox():
            break
        time.sleep(0.1)
    assert sid not in pids_by_sandbox(), "processes of the stopped sandbox are left"
    assert not Path(f"/sys/class/net/{veth_name(sid)}").exists(), "veth left behind"
