"""Per-sandbox network policy (cgroup-BPF) with real sandboxes.

The only peers these tests talk to: a test host in a network namespace this module creates
(routed from the host, 10.199.N.0/24), the sandboxes' own loopback, and addresses of this host
that must stay unreachable. Nothing else is ever targeted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec import NetworkPolicy
from dsec.backends.container import cgroups
from dsec.backends.container.network import NetSettings, veth_name
from dsec.backends.container.spec import cgroup_path
from dsec.security import netpolicy
from dsec.types import InvalidArgument
from dsec.testing.waiting import wait_until

from conftest import requires_root

PROBE = (Path(__file__).with_name("net_probe.py")).read_text()
NET = NetSettings()           # the server under test runs with the defaults
GATEWAY = str(NET.gateway)

TESTHOST_SERVER = r"""
import socket, sys, threading
log = open(sys.argv[1], "a", buffering=1)
def tcp(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    while True:
        c, _ = s.accept()
        c.sendall(b"hello-%d\n" % port)
        c.close()
def udp(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    while True:
        d, a = s.recvfrom(2048)
        log.write("udp %d %s\n" % (port, d.decode(errors="replace")))
        s.sendto(b"pong", a)
for p in (8080, 8081):
    threading.Thread(target=tcp, args=(p,), daemon=True).start()
threading.Thread(target=udp, args=(53,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@dataclass
class PeerHost:
    ip: str
    log: Path

    def udp_seen(self, marker: str) -> bool:
        return marker in self.log.read_text()


def _sh(cmd: str) -> None:
    subprocess.run(cmd.split(), check=True, capture_output=True)


@pytest.fixture(scope="module")
def testhost(tmp_path_factory):
    """Our own peer: TCP 8080/8081 (banner "hello-<port>") and UDP 53 (logs, answers "pong")."""
    requires_root()
    tag = os.getpid() % 100000
    n = 20 + os.getpid() % 200
    ns, hveth = f"dsect{tag}", f"dsth{tag}"
    log = tmp_path_factory.mktemp("testhost") / "udp.log"
    log.touch()
    proc = None
    _sh(f"ip netns add {ns}")
    try:
        _sh(f"ip link add {hveth} type veth peer name eth0 netns {ns}")
        _sh(f"ip addr add 10.199.{n}.1/24 dev {hveth}")
        _sh(f"ip link set {hveth} up")
        _sh(f"ip -n {ns} addr add 10.199.{n}.2/24 dev eth0")
        _sh(f"ip -n {ns} link set eth0 up")
        _sh(f"ip -n {ns} link set lo up")
        _sh(f"ip -n {ns} route add default via 10.199.{n}.1")
        Path(f"/proc/sys/net/ipv4/conf/{hveth}/forwarding").write_text("1")   # replies back to the bridge
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", TESTHOST_SERVER, str(log)],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert proc.stdout.readline().strip() == b"ready"
        yield PeerHost(f"10.199.{n}.2", log)
    finally:
        if proc:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", hveth], capture_output=True)


@pytest.fixture(scope="module")
def rulesets(server, testhost):
    path = server.home / netpolicy.RULESETS_FILE
    path.write_text(json.dumps({
        "testhost-http": {"description": "the test host's HTTP port",
                          "rules": [{"cidr": testhost.ip, "ports": [8080], "protocol": "tcp"}]},
        "testhost-dns": {"rules": [{"cidr": testhost.ip, "ports": 53, "protocol": "udp"}]},
    }))
    yield path
    path.unlink(missing_ok=True)


# -- helpers ------------------------------------------------------------------------------


async def probe(sb, checks: list[list], user: str = "root") -> dict:
    await sb.files.write("/tmp/probe.py", PROBE)
    r = await sb.run(f"python3 /tmp/probe.py '{json.dumps(checks)}'", user=user, timeout_s=60)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def cg_dir(sandbox_id: str) -> Path:
    return cgroups.v2_dir(cgroup_path(sandbox_id))


def net_rows(server) -> dict[str, str | None]:
    with sqlite3.connect(server.paths.edge_db) as db:
        return dict(db.execute("SELECT sandbox_id, ip FROM net_sandboxes").fetchall())


def nft_table_exists() -> bool:
    return subprocess.run(["nft", "list", "table", "inet", NET.nft_table], capture_output=True).returncode == 0


def pinned_dsec_objects() -> list[str]:
    root = Path("/sys/fs/bpf")
    if not root.is_dir():
        return []
    return [str(p) for p in root.rglob("*") if "dsec" in p.name or "netpolicy" in p.name]


async def wait_for(cond, timeout_s: float = 5.0) -> bool:
    return bool(await wait_until(cond, timeout_s=timeout_s, every_s=0.05))


async def assert_net_freed(server, sandbox_id: str, cgid: int) -> None:
    assert not Path(f"/sys/class/net/{veth_name(sandbox_id)}").exists(), "veth left behind"
    assert sandbox_id not in net_rows(server), "IPAM entry left behind"
    assert not cg_dir(sandbox_id).exists(), "cgroup (and with it the BPF attachments) left behind"
    assert await wait_for(lambda: netpolicy.policy_entries_for(cgid) == 0), "BPF map entries left behind"
    assert pinned_dsec_objects() == []


def deny(result: str) -> bool:
    return result == "err:EPERM"


# -- tests --------------------------------------------------------------------------------


async def test_default_is_deny_all_fast_eperm_loopback_works_no_veth(client, server, testhost):
    sb = await client.create_container(image="busybox")
    assert sb.info.network == NetworkPolicy()
    cgid = os.stat(cg_dir(sb.id)).st_ino
    assert netpolicy.attached_programs(cg_dir(sb.id)) == sorted(netpolicy.PROGRAMS)
    assert not Path(f"/sys/class/net/{veth_name(sb.id)}").exists() and sb.id not in net_rows(server)
    r = await sb.run(f"nc -w 5 {testhost.ip} 8080 </dev/null 2>&1; "
                     f"nslookup exfil.example {testhost.ip} 2>&1; "      # DNS over UDP
                     f"nc -w 5 {GATEWAY} {server.port} </dev/null 2>&1")
    assert r.stdout.count("Operation not permitted") == 3, r.stdout + r.stderr
    assert r.duration_s < 1.5, "denied connects must fail at once, not time out"
    assert not testhost.udp_seen("exfil")
    r = await sb.run("nc -l -p 9000 -e echo inside & sleep 0.2; nc 127.0.0.1 9000 </dev/null; "
                     "grep -c : /proc/net/dev")
    assert r.stdout.split() == ["inside", "1"], r.stdout + r.stderr   # loopback works; lo is the only link
    await sb.stop()
    await assert_net_freed(server, sb.id, cgid)


async def test_allow_one_port_udp_dns_and_live_policy_changes(client, server, testhost):
    h = testhost.ip
    sb = await client.create_container(image="debian-python", network={
        "rules": [{"cidr": h, "ports": [8080], "protocol": "tcp"}]})
    cgid = os.stat(cg_dir(sb.id)).st_ino
    ip = net_rows(server)[sb.id]
    assert ip and Path(f"/sys/class/net/{veth_name(sb.id)}").exists()
    r = await probe(sb, [
        ["http", "tcp", h, 8080], ["other_port", "tcp", h, 8081],
        ["mapped_ok", "tcp", f"::ffff:{h}", 8080, "inet6"], ["mapped_other", "tcp", f"::ffff:{h}", 8081, "inet6"],
        ["dns_sendto", "udp_sendto", h, 53, "exfil-1"], ["dns_connect", "udp_connect", h, 53, "exfil-1"],
        ["fastopen_other", "fastopen", h, 8081], ["gateway_api", "tcp", GATEWAY, server.port],
        ["raw", "sock", "raw"], ["packet", "sock", "packet"], ["udplite", "sock", "udplite"],
        ["loopback", "loopback"]])
    assert r["http"] == r["mapped_ok"] == "ok:hello-8080", r
    for k in ("other_port", "mapped_other", "fastopen_other", "gateway_api", "raw", "packet", "udplite"):
        assert deny(r[k]), (k, r)
        assert r[k + ".s"] < 0.5, (k, r)
    assert r["loopback"] == "ok:lo"
    # port 53 of any address goes to the node's DNS forwarder (egress is on), which drops what
    # is not DNS: never to the test host
    assert r["dns_sendto"] == r["dns_connect"] == "err:TIMEOUT", r
    await asyncio.sleep(0.2)
    assert not testhost.udp_seen("exfil-1")

    # widen: even a rule naming the test host's port 53 does not bypass the forwarder
    info = await sb.set_network(rules=[{"cidr": h, "ports": [8080], "protocol": "tcp"},
                                       {"cidr": f"{h}/32", "ports": "53", "protocol": "udp"}])
    assert [x.protocol for x in info.network.rules] == ["tcp", "udp"]
    r = await probe(sb, [["dns", "udp_sendto", h, 53, "allowed-2"], ["other_port", "tcp", h, 8081]])
    assert r["dns"] == "err:TIMEOUT" and deny(r["other_port"]), r
    assert not testhost.udp_seen("allowed-2")

    # narrow to nothing: takes effect at once; the veth stays (re-allowing is a map update)
    await sb.set_network(NetworkPolicy())
    r = await probe(sb, [["http", "tcp", h, 8080], ["dns", "udp_sendto", h, 53, "denied-3"]])
    assert deny(r["http"]) and deny(r["dns"]), r
    # and back, to the other port only
    await sb.set_network({"rules": [{"cidr": "10.199.0.0/16", "ports": ["8081"], "protocol": "tcp"}]})
    r = await probe(sb, [["http", "tcp", h, 8080], ["other", "tcp", h, 8081]])
    assert deny(r["http"]) and r["other"] == "ok:hello-8081", r
    assert (await sb.refresh()).network.rules[0].ports == [8081]
    assert net_rows(server)[sb.id] == ip            # same address throughout
    await sb.stop()
    await assert_net_freed(server, sb.id, cgid)


async def test_host_is_unreachable_even_when_a_policy_allows_it(client, server, testhost):
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))   # a host service on every address, including the bridge's
    listener.listen(4)
    port = listener.getsockname()[1]
    try:
        sb = await client.create_container(image="debian-python", network={
            "rules": [{"cidr": f"{GATEWAY}/32"}, {"cidr": testhost.ip, "ports": [8080]}]})
        r = await probe(sb, [["host", "tcp", GATEWAY, port], ["api", "tcp", GATEWAY, server.port],
                             ["peer", "tcp", testhost.ip, 8080]])
        assert r["host"] == "err:TIMEOUT" and r["api"] == "err:TIMEOUT", r   # dropped by the host firewall
        assert r["peer"] == "ok:hello-8080", r
        await sb.stop()
    finally:
        listener.close()


async def test_named_rule_sets_on_off_and_unknown_names(client, server, testhost, rulesets):
    h = testhost.ip
    sb = await client.create_container(image="busybox", network={
        "rulesets": {"testhost-http": True, "testhost-dns": False}})
    assert sb.info.network.rulesets == {"testhost-http": True, "testhost-dns": False}
    r = await sb.run(f"nc -w 3 {h} 8080 </dev/null; nslookup rulesets-probe.example {h} 2>&1")
    # DNS to any address is answered by the node's forwarder (egress is on; its upstream here is a
    # closed local port, so SERVFAIL), never by the test host, whatever the rule sets say
    assert "hello-8080" in r.stdout and "SERVFAIL" in r.stdout, r
    assert not testhost.udp_seen("rulesets-probe")
    await sb.set_network(rulesets={"testhost-http": False})
    r = await sb.run(f"nc -w 3 {h} 8080 </dev/null")
    assert "not permitted" in r.stderr + r.stdout, r
    with pytest.raises(InvalidArgument) as e:
        await sb.set_network(rulesets={"testhost-http": True, "nope": True})
    assert e.value.field == "rulesets.nope"
    assert "testhost-dns" in e.value.message and "testhost-http" in e.value.message
    with pytest.raises(InvalidArgument) as e:
        await client.create_container(image="busybox", network={"rulesets": {"pypi-typo": True}})
    assert e.value.field == "network.rulesets.pypi-typo" and "testhost-http" in e.value.message
    await sb.stop()


async def test_bad_cidrs_and_ports_are_422_naming_the_field(client):
    cases = [({"rules": [{"cidr": "10.0.0.0/33"}]}, "network.rules.0.cidr"),
             ({"rules": [{"cidr": "example.com"}]}, "network.rules.0.cidr"),
             ({"rules": [{"cidr": "::/0", "ports": [70000]}]}, "network.rules.0.ports"),
             ({"rules": [{"cidr": "::/0", "ports": "9-1"}]}, "network.rules.0.ports"),
             ({"rules": [{"cidr": "::/0", "protocol": "icmp"}]}, "network.rules.0.protocol"),
             ({"rules": [{"cidr": "1.2.3.4", "ports": list(range(1, 40, 2))}]}, "network.rules")]
    for network, field in cases:
        with pytest.raises(InvalidArgument) as e:   # raw JSON: the server validates, not the SDK
            await client._request("POST", "/v1/sandboxes", content=json.dumps({"image": "busybox", "network": network}),
                                  headers={"Content-Type": "application/json"})
        assert e.value.field == field, (network, e.value.field, e.value.message)
    sb = await client.create_container(image="busybox")
    with pytest.raises(InvalidArgument) as e:
        await client._request("PUT", f"/v1/sandboxes/{sb.id}/network", content=json.dumps({"rules": [{"cidr": "1.2.3"}]}),
                              headers={"Content-Type": "application/json"})
    assert e.value.field == "rules.0.cidr"
    await sb.stop()


async def test_two_sandboxes_with_different_policies_do_not_affect_each_other(client, server, testhost):
    h = testhost.ip
    a = await client.create_container(image="debian-python", network={
        "rules": [{"cidr": h, "ports": [8080], "protocol": "tcp"}, {"cidr": NET.subnet, "protocol": "tcp"}]})
    b = await client.create_container(image="debian-python", network={
        "rules": [{"cidr": h, "ports": [8081], "protocol": "tcp"}]})
    await b.run("python3 -c 'import socket,os\ns=socket.socket();s.bind((\"0.0.0.0\",9000));s.listen(1)\n"
                "if os.fork()==0:\n  c,_=s.accept();c.send(b\"b\")' &", user="root")
    b_ip = net_rows(server)[b.id]
    ra = await probe(a, [["h80", "tcp", h, 8080], ["h81", "tcp", h, 8081], ["b", "tcp", b_ip, 9000]])
    rb = await probe(b, [["h80", "tcp", h, 8080], ["h81", "tcp", h, 8081]])
    assert ra["h80"] == "ok:hello-8080" and deny(ra["h81"]), ra
    assert rb["h81"] == "ok:hello-8081" and deny(rb["h80"]), rb
    assert not ra["b"].startswith("ok"), ra      # sandboxes cannot reach each other
    await a.set_network()                         # A's change leaves B alone
    assert deny((await probe(a, [["h80", "tcp", h, 8080]]))["h80"])
    assert (await probe(b, [["h81", "tcp", h, 8081]]))["h81"] == "ok:hello-8081"
    await a.stop()
    await b.stop()


async def test_edge_kill_restart_keeps_enforcing_and_leaks_nothing(server, testhost):
    h = testhost.ip
    async with server.client() as c:
        keep = await c.create_container(image="debian-python", network={"rules": [{"cidr": h, "ports": [8080]}]})
        doomed = await c.create_container(image="busybox", network={"rules": [{"cidr": h, "ports": [8081]}]})
        quiet = await c.create_container(image="busybox")
    cg = {s.id: os.stat(cg_dir(s.id)).st_ino for s in (keep, doomed, quiet)}
    server.kill(signal.SIGKILL)
    # while the edge is down its programs stay attached and keep enforcing
    assert netpolicy.attached_programs(cg_dir(keep.id)) == sorted(netpolicy.PROGRAMS)
    assert netpolicy.policy_entries_for(cg[keep.id]) > 0
    # one sandbox dies behind the edge's back
    subprocess.run(["crun", "--root", str(server.paths.crun_root), "delete", "-f", doomed.id], check=True)
    server.start()
    async with server.client() as c:
        assert (await c.get(doomed.id)).info.state.value == "failed"
        await assert_net_freed(server, doomed.id, cg[doomed.id])
        keep = await c.get(keep.id)
        # exactly one generation of programs decides now (the restarted edge's)
        assert netpolicy.attached_programs(cg_dir(keep.id)) == sorted(netpolicy.PROGRAMS)
        assert netpolicy.attached_programs(cg_dir(quiet.id)) == sorted(netpolicy.PROGRAMS)
        r = await probe(keep, [["h80", "tcp", h, 8080], ["h81", "tcp", h, 8081]])
        assert r["h80"] == "ok:hello-8080" and deny(r["h81"]), r
        await keep.set_network(rules=[{"cidr": h, "ports": [8081]}])
        r = await probe(keep, [["h80", "tcp", h, 8080], ["h81", "tcp", h, 8081]])
        assert deny(r["h80"]) and r["h81"] == "ok:hello-8081", r
        await keep.stop()
        await (await c.get(quiet.id)).stop()
    for sid in (keep.id, quiet.id):
        await assert_net_freed(server, sid, cg[sid])


async def test_nothing_left_on_the_host(server):
    """After every networked sandbox is gone: no veth, bridge, NAT table, IPAM row or pin."""
    assert net_rows(server) == {}
    assert not Path(f"/sys/class/net/{NET.bridge}").exists()
    assert not any(p.name.startswith("dsv") for p in Path("/sys/class/net").iterdir())
    assert not nft_table_exists()
    assert pinned_dsec_objects() == []


# -- pure policy compilation (no root needed) -----------------------------------------------


def test_each_prefix_carries_the_ranges_of_every_rule_containing_it():
    from ipaddress import ip_network as N
    from dsec.security.netpolicy import Allow, compile_allows
    e = compile_allows([Allow("10.0.0.0/8", 80, 80, 1), Allow("10.1.2.3/32", 443, 443, 1),
                        Allow("10.1.2.3/32", 440, 450, 1), Allow("10.1.2.3/32", 443, 443, 2),
                        Allow("::ffff:10.9.0.0/112", 53, 53, 2), Allow("2001:db8::/32", 0, 65535, 3)])
    assert e[N("10.0.0.0/8")] == [(80, 80, 1)]
    assert e[N("10.1.2.3/32")] == [(80, 80, 1), (440, 450, 1), (443, 443, 2)]   # merged, /8's port kept
    assert e[N("10.9.0.0/16")] == [(53, 53, 2), (80, 80, 1)]                   # v4-mapped -> IPv4
    assert e[N("2001:db8::/32")] == [(0, 65535, 3)]


def test_policy_model_normalises_and_rejects():
    from pydantic import ValidationError
    from dsec import NetworkRule
    r = NetworkRule(cidr=" 10.1.2.3/8 ", ports=[443, "8000 - 8100", "22"], protocol="tcp")
    assert r.cidr == "10.0.0.0/8" and r.ports == [443, "8000-8100", 22]
    assert r.port_ranges() == [(443, 443), (8000, 8100), (22, 22)]
    assert NetworkRule(cidr="::1").port_ranges() == [(0, 65535)]
    for bad in ({"cidr": "300.1.1.1"}, {"cidr": "::/0", "ports": True}, {"cidr": "::/0", "ports": []},
                {"cidr": "::/0", "ports": "0"}, {"cidr": "::/0", "ports": "1-2-3"}, {"cidr": "::/0", "x": 1}):
        with pytest.raises(ValidationError):
            NetworkRule.model_validate(bad)
