"""DNS and egress by name for microVM sandboxes (issue 25 for VMs), with real QEMU guests.

A VM created with `network` gets a NIC on QEMU's user-mode network; its QEMU runs in a netns
and cgroup the node's sandbox network governs like a container's (backends/vm/network.py).
Peers (tests/egress_peer.py): a DNS server and HTTP/HTTPS servers in a namespace; the server
under test runs on a bridge of its own. One VM guest carries most checks (TCG is slow).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from dsec.types import DsecError

from egress_peer import PROBE, egress_peer, probe, side_server


@pytest.fixture(scope="module")
def vpeer(tmp_path_factory):
    """The peer (egress_peer.py) with names allowed.test, other.test, a.wild.test -> its first address."""
    from conftest import requires_root
    requires_root()
    with egress_peer(tmp_path_factory.mktemp("vm-egress-peer")) as p:
        p.set_zone({"allowed.test": p.ip, "other.test": p.ip, "a.wild.test": p.ip})
        yield p


@pytest.fixture(scope="module")
def vserver(images, dsec_home, tmp_path_factory, vpeer):
    """A server with VM backends on a bridge of its own, its forwarder asking the peer."""
    with side_server(dsec_home, tmp_path_factory, "vmegress", vpeer, vm=True) as srv:
        yield srv


async def _vm_backends(c) -> None:
    if "microvm" not in (await c.nodes())[0].backends:
        pytest.skip("the node offers no VM backends: guest kernel not fetched (dsec vm fetch-kernel)")


async def test_vm_domains_dns_bypasses_set_network_and_resume(vserver, vpeer):
    peer = vpeer
    """One guest: names allowed by SNI/Host at the node proxy, the forwarder answering only
    those; the bypasses (raw IP, other SNI, DNS to another address or over TCP, other ports,
    IPv6) fail; set_network counts for the next connection; a parked VM comes back plugged in
    under the same policy."""
    async with vserver.client() as c:
        await _vm_backends(c)
        sb = await c.create_microvm(image="debian-python", network={"domains": ["allowed.test", "*.wild.test"]})
        try:
            assert sb.info.network is not None and sb.info.network.domains == ["allowed.test", "*.wild.test"]
            # the guest's sockets are its QEMU's: in the sandbox's cgroup and a netns of its own
            pid = int((vserver.paths.vm_sandboxes / sb.id / "qemu.pid").read_text())
            assert f"/dsec/{sb.id}" in Path(f"/proc/{pid}/cgroup").read_text()
            assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
            r = await probe(sb, [
                ["resolv", "resolve", "allowed.test"], ["dns_other", "resolve", "other.test"],
                ["dns_wild", "resolve", "a.wild.test"],
                ["http", "http", "allowed.test", 80, "allowed.test"],
                ["https", "https", "allowed.test", 443, "allowed.test"],
                ["wild", "https", "a.wild.test", 443, "a.wild.test"],
                ["http_other", "http", peer.ip, 80, "other.test"],
                ["https_other", "https", peer.ip, 443, "other.test"],
                ["https_nosni", "https", peer.ip, 443, ""],
                ["raw_other", "http", peer.ip2, 80, "other.test"],
                ["raw_allowed", "http", peer.ip2, 80, "allowed.test"],
                ["raw_port", "tcp", peer.ip2, 8080],
                ["udp_other_resolver", "dns", peer.ip2, "other.test", False],
                ["udp_other_resolver_ok", "dns", peer.ip2, "allowed.test", False],
                ["tcp_dns_other", "dns", peer.ip, "other.test", True],
                ["tcp_dns_allowed", "dns", peer.ip2, "allowed.test", True],
                ["ipv6", "tcp6", "2001:db8::1", 443],
            ])
            assert r["resolv"] == r["dns_wild"] == f"ok:{peer.ip}", r
            assert r["dns_other"].startswith("err:gaierror"), r
            assert r["http"] == f"ok:200 {peer.ip} allowed.test -", r
            assert r["https"] == f"ok:{peer.ip} allowed.test allowed.test", r
            assert r["wild"] == f"ok:{peer.ip} a.wild.test a.wild.test", r
            assert r["http_other"].startswith("ok:403 dsec: egress to other.test is not allowed"), r
            assert r["https_other"].startswith("err:") and r["https_nosni"].startswith("err:"), r
            assert r["raw_other"].startswith("ok:403"), r
            assert r["raw_allowed"] == f"ok:200 {peer.ip} allowed.test -", r
            assert r["raw_port"].startswith("err:"), r            # other ports: CIDR rules only
            # peer.ip2 runs no DNS server: an answer proves the query went to the forwarder
            assert r["udp_other_resolver"] == "ok:rcode=5 an=0", r
            assert r["udp_other_resolver_ok"] == "ok:rcode=0 an=1", r
            assert r["tcp_dns_other"] == "ok:rcode=5 an=0" and r["tcp_dns_allowed"] == "ok:rcode=0 an=1", r
            assert r["ipv6"].startswith("err:"), r
            # the guest's resolver is the node's (read-only in the guest)
            out = await sb.run("cat /etc/resolv.conf; echo x > /etc/resolv.conf", user="root")
            assert out.stdout.startswith("nameserver ") and out.exit_code != 0, out

            t0 = time.monotonic()
            await sb.set_network(domains=["other.test"])
            assert time.monotonic() - t0 < 1.0
            r = await probe(sb, [["a", "http", peer.ip, 80, "allowed.test"],
                                 ["o", "http", "other.test", 80, "other.test"]])
            assert r["a"].startswith("ok:403") and r["o"] == f"ok:200 {peer.ip} other.test -", r

            await sb.suspend()
            await sb.resume()
            r = await probe(sb, [["o", "http", "other.test", 80, "other.test"]])
            assert r["o"] == f"ok:200 {peer.ip} other.test -", r

            await sb.set_network()   # nothing: no DNS, no connection
            r = await probe(sb, [["dns", "dns", peer.ip, "other.test", False],
                                 ["http", "http", peer.ip, 80, "other.test"]])
            assert r["dns"].startswith("err:") and r["http"].startswith("err:"), r
        finally:
            await sb.stop()
        # nothing of it left on the node: no address, no veth, no cgroup
        import sqlite3
        with sqlite3.connect(vserver.paths.edge_db) as db:
            assert db.execute("SELECT count(*) FROM net_sandboxes WHERE sandbox_id=?", (sb.id,)).fetchone()[0] == 0


async def test_vm_network_errors_name_the_field(vserver):
    async with vserver.client() as c:
        await _vm_backends(c)
        with pytest.raises(DsecError) as e:
            await c.create_microvm(image="debian-python", network={"rulesets": {"nope": True}})
        assert e.value.field == "network.rulesets.nope", e.value
        with pytest.raises(DsecError) as e:
            await c.create_microvm(image="debian-python",
                                   network={"egress_proxy": {"address": "192.0.2.1:1080"}})
        assert e.value.field == "network.egress_proxy", e.value
        sb = await c.create_microvm(image="busybox")      # no network: no NIC at all
        try:
            assert sb.info.network is None
            assert "eth0" not in (await sb.run("ls /sys/class/net")).stdout
            with pytest.raises(DsecError) as e:
                await sb.set_network(domains=["allowed.test"])
            assert e.value.field == "network" and "network={}" in (e.value.fix or ""), e.value
        finally:
            await sb.stop()


def test_stock_e2b_sdk_vm_allow_out_and_update_network(vserver, vpeer, monkeypatch):
    """The stock e2b SDK: a microVM (metadata dsec.backend) with allow_out by name, then
    update_network (PUT /sandboxes/{id}/network) to another name."""
    e2b = pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")
    url = f"{vserver.url}/e2b"
    for k, v in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": vserver.key,
                 "E2B_DOMAIN": "dsec.invalid"}.items():
        monkeypatch.setenv(k, v)
    peer = vpeer

    def run(sbx, checks: list[list]) -> dict:
        sbx.files.write("/tmp/eprobe.py", PROBE)
        r = sbx.commands.run(f"python3 /tmp/eprobe.py '{json.dumps(checks)}'", user="root", timeout=240)
        return json.loads(r.stdout)

    sbx = e2b.Sandbox.create("debian-python", timeout=600, metadata={"dsec.backend": "microvm"},
                             network={"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]})
    try:
        r = run(sbx, [["http", "http", "allowed.test", 80, "allowed.test"],
                      ["other", "http", peer.ip, 80, "other.test"], ["raw", "tcp", peer.ip2, 8080]])
        assert r["http"] == f"ok:200 {peer.ip} allowed.test -", r
        assert r["other"].startswith("ok:403") and r["raw"].startswith("err:"), r
        t0 = time.monotonic()
        sbx.update_network({"allow_out": ["other.test"], "deny_out": ["0.0.0.0/0"]})
        assert time.monotonic() - t0 < 1.0
        r = run(sbx, [["allowed", "http", peer.ip, 80, "allowed.test"],
                      ["other", "http", "other.test", 80, "other.test"]])
        assert r["allowed"].startswith("ok:403") and r["other"] == f"ok:200 {peer.ip} other.test -", r
        with pytest.raises(e2b.exceptions.SandboxException, match="network.egressProxy"):
            e2b.Sandbox.create("debian-python", metadata={"dsec.backend": "microvm"},
                               network={"egress_proxy": {"address": "192.0.2.1:1080"}})
    finally:
        sbx.kill()


async def test_q35_vm_policy_holds_across_an_edge_restart(vserver, vpeer):
    """The edge killed and started again (VMs keep running): the VM's row, address and BPF
    entries are kept (the VM driver names its networked VMs to the node network's recover),
    the forwarder and proxy come back, the policy still decides. A q35 `vm` (virtio-net-pci)
    where the others are microVMs. Last in the module: it restarts the module's server."""
    peer = vpeer
    async with vserver.client() as c:
        await _vm_backends(c)
        sb = await c.create_vm(image="debian-python", network={"domains": ["allowed.test"]})
    vserver.kill(signal.SIGKILL)
    vserver.start(timeout_s=180)
    async with vserver.client() as c:
        sb = await c.get(sb.id)
        try:
            r = await probe(sb, [["a", "http", "allowed.test", 80, "allowed.test"],
                                 ["o", "http", peer.ip, 80, "other.test"], ["raw", "tcp", peer.ip2, 8080]])
            assert r["a"] == f"ok:200 {peer.ip} allowed.test -", r
            assert r["o"].startswith("ok:403") and r["raw"].startswith("err:"), r
        finally:
            await sb.stop()
