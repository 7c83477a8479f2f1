"""Cluster mode with each edge in a network namespace of its own (D40): a real local Ray
cluster (two raylets), `local_cluster(edge_netns=True)`. Each edge's bridge and nft table exist
only in its netns `dsec-<node>`, not on the host, not in the other edge's; a networked sandbox on
each node runs commands and reaches a peer host through its edge's gateway (two NATs: the edge's,
then the host's); it cannot reach the host, its own edge or the other edge even when its policy
allows them; an edge process killed with its actor comes back in the same netns, and its
sandboxes keep their network. After teardown no netns, veth or nft table of the nodes is left.

The only peers: a test host in a network namespace this module creates (10.198.N.0/24, routed
from the host), and addresses of this host and of the edges that must stay unreachable.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import NO_PSI_ADMISSION, requires_root

from dsec import Client
from dsec.cluster.names import bridge_name
from dsec.types import DsecError

pytest.importorskip("ray", reason="cluster mode needs ray: pip install -e '.[cluster]'")

PEER_SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080))
s.listen(64)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"hello-peer\n")
    c.close()
"""


def _hostport(url: str) -> str:
    """host:port of an edge URL (https: the edges serve TLS, cluster_ca.py)."""
    return url.split("://", 1)[1]


def _sh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True)


@pytest.fixture(scope="module")
def peer():
    """A host outside the cluster: TCP 8080 answers "hello-peer"."""
    requires_root()
    tag = os.getpid() % 100000
    n = 20 + os.getpid() % 200
    ns, hveth = f"d40p{tag}", f"d40h{tag}"
    proc = None
    assert _sh("ip", "netns", "add", ns).returncode == 0
    try:
        for cmd in (f"ip link add {hveth} type veth peer name eth0 netns {ns}",
                    f"ip addr add 10.198.{n}.1/24 dev {hveth}", f"ip link set {hveth} up",
                    f"ip -n {ns} addr add 10.198.{n}.2/24 dev eth0", f"ip -n {ns} link set eth0 up",
                    f"ip -n {ns} link set lo up", f"ip -n {ns} route add default via 10.198.{n}.1"):
            p = _sh(*cmd.split())
            assert p.returncode == 0, (cmd, p.stderr)
        Path(f"/proc/sys/net/ipv4/conf/{hveth}/forwarding").write_text("1")    # replies back to the edges
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", PEER_SERVER],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield f"10.198.{n}.2"
    finally:
        if proc:
            proc.kill()
            proc.wait()
        _sh("ip", "netns", "del", ns)
        _sh("ip", "link", "del", hveth)


@pytest.fixture(scope="module")
def host_listener():
    """A service of this host on every address (the veths' host ends included)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 0))
    s.listen(16)
    stop = threading.Event()

    def serve() -> None:
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = s.accept()
            except OSError:
                continue
            c.sendall(b"hello-host\n")
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield s.getsockname()[1]
    stop.set()
    t.join()
    s.close()


class Cluster:
    def __init__(self, local, clients: list[Client], edges: dict[str, dict]):
        self.local = local
        self.clients = clients
        self.edges = edges          # dsec node id -> its actor's address()


@pytest.fixture(scope="module")
async def cluster():
    requires_root()
    from dsec.cluster import netns
    from dsec.cluster.discovery import EDGE_PREFIX, actor_address
    from dsec.cluster.local import local_cluster

    async with local_cluster(nodes=2, replicas=2, edge_env=NO_PSI_ADMISSION, edge_netns=True) as local:
        edges = {n: await actor_address(EDGE_PREFIX + n) for n in local.nodes}
        clients = [Client(url, local.admin_key) for url in local.replica_urls]
        try:
            yield Cluster(local, clients, edges)
        finally:
            try:      # the last test ends the cluster itself (`down`): then local_cluster cleans up
                for sb in await clients[0].list():
                    await (await clients[0].get(sb.id)).stop()
            except Exception:
                pass
            for c in clients:
                await c.close()
        node_ids, homes = list(local.nodes), local.homes
    assert netns.leftovers(node_ids) == []          # netns, veth pair, host nft table: all gone
    assert not any(Path(f"/run/netns/{netns.NAME_PREFIX}{n}").exists() for n in node_ids)
    for h in homes:
        assert not h.exists()


def _node(sb) -> str:
    return sb.id.removeprefix("sb-").split(".")[0]


def _in_ns(node: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return _sh("nsenter", f"--net=/run/netns/dsec-{node}", *argv)


async def _spread(cluster: Cluster, make, want: int = 1, tries: int = 12) -> dict[str, list]:
    """Sandboxes created through both replicas until every node has `want` of them."""
    by_node: dict[str, list] = {n: [] for n in cluster.edges}
    for i in range(tries):
        sb = await make(cluster.clients[i % 2])
        by_node[_node(sb)].append(sb)
        if all(len(v) >= want for v in by_node.values()):
            break
    return by_node


async def test_creates_through_the_replicas_reach_every_edge_in_its_netns(cluster):
    for node, a in cluster.edges.items():
        assert a["netns"] == f"dsec-{node}" and Path(f"/run/netns/dsec-{node}").exists()
        host = _hostport(a["url"]).rsplit(":", 1)[0]
        assert ipaddress.ip_address(host) in ipaddress.ip_network(cluster.local.settings.netns_pool)
        # the edge serves from inside its netns: its address is one of that netns', not the host's
        assert f"inet {host}/30" in _in_ns(node, "ip", "-4", "addr", "show", "dev", "eth0").stdout
        assert host not in _sh("ip", "-4", "addr").stdout
        assert a["edge_pid"] != a["pid"]
    by_node = await _spread(cluster, lambda c: c.create_container(image="busybox", memory_mb=64, cpu_cores=0.1))
    assert all(by_node.values()), {n: len(v) for n, v in by_node.items()}   # both nodes, through both replicas
    for node, sbs in by_node.items():
        r = await (await cluster.clients[1].get(sbs[0].id)).run("echo ok")
        assert r.stdout == "ok\n"


async def test_each_edge_network_lives_only_in_its_netns(cluster, peer, host_listener):
    from dsec.cluster import netns
    nodes = sorted(cluster.edges)
    links = {n: netns.EdgeNetns(n, str(ipaddress.ip_network(
        _hostport(cluster.edges[n]["url"]).rsplit(":", 1)[0] + "/30", strict=False))) for n in nodes}
    pool = cluster.local.settings.netns_pool
    host_ips = [a.split("/")[0] for a in _sh("ip", "-4", "-o", "addr").stdout.split() if "/" in a
                and not a.startswith("127.")]
    rules = [{"cidr": f"{peer}/32", "ports": [8080]}, {"cidr": pool}, *({"cidr": f"{ip}/32"} for ip in host_ips)]
    by_node = await _spread(cluster, lambda c: c.create_container(
        image="busybox", memory_mb=64, cpu_cores=0.1, network={"rules": rules}))
    assert all(by_node.values()), {n: len(v) for n, v in by_node.items()}
    for node in nodes:
        bridge = bridge_name(node)
        table = f"dsec_{bridge}".replace("-", "_")      # network.py's nft_table
        other = next(n for n in nodes if n != node)
        # the bridge and its nft table: in this edge's netns only
        assert _in_ns(node, "ip", "link", "show", bridge).returncode == 0
        assert _in_ns(node, "nft", "list", "table", "inet", table).returncode == 0
        assert not Path(f"/sys/class/net/{bridge}").exists()
        assert _sh("nft", "list", "table", "inet", table).returncode != 0
        assert _in_ns(other, "ip", "link", "show", bridge).returncode != 0
        assert _in_ns(other, "nft", "list", "table", "inet", table).returncode != 0
        # its sandboxes' veths are on that bridge, in there
        assert netns.plugged_sandboxes(links[node])

        sb = by_node[node][0]
        gw = str(ipaddress.ip_network(cluster.edges[node]["subnet"]).network_address + 1)
        r = await sb.run("ip route; echo | nc -w 3 " + peer + " 8080", timeout_s=30)
        assert f"default via {gw}" in r.stdout, r.stdout         # through its edge's gateway ...
        assert "hello-peer" in r.stdout, r                      # ... and both NATs, to the peer
        # containment: allowed by its policy, yet unreachable (the edges' and the host's firewalls)
        own_url, other_url = cluster.edges[node]["url"], cluster.edges[other]["url"]
        targets = {"own edge": _hostport(own_url).replace(":", " "),
                   "other edge": _hostport(other_url).replace(":", " "),
                   "own veth host end": f"{links[node].host_ip} {host_listener}",
                   "other veth host end": f"{links[other].host_ip} {host_listener}",
                   **{f"host {ip}": f"{ip} {host_listener}" for ip in host_ips}}
        targets["control"] = f"{peer} 8080"                     # allowed and reachable: the probes work
        script = " ".join(f"(echo | nc -w 2 {v} 2>&1 | sed 's/^/{k}: /') &" for k, v in targets.items()) + " wait"
        r = await sb.run(script, timeout_s=60)
        assert "control: hello-peer" in r.stdout, r.stdout
        assert "hello-host" not in r.stdout, r.stdout
        assert "HTTP/" not in r.stdout, r.stdout


async def test_edge_killed_with_its_actor_comes_back_in_the_same_netns(cluster, peer):
    """SIGKILL the actor: its edge process dies with it (PR_SET_PDEATHSIG); Ray restarts the
    actor, which starts a new edge in the netns left standing: the sandbox answers and still
    reaches the peer through the same bridge."""
    from dsec.cluster.discovery import EDGE_PREFIX, actor_address
    node = sorted(cluster.edges)[0]
    c0, c1 = cluster.clients
    sb = None
    for i in range(12):
        cand = await cluster.clients[i % 2].create_container(
            image="busybox", memory_mb=64, cpu_cores=0.1, network={"rules": [{"cidr": f"{peer}/32", "ports": [8080]}]})
        if _node(cand) == node:
            sb = cand
            break
    assert sb is not None, "placement put none of 12 sandboxes on the first node"
    before = await actor_address(EDGE_PREFIX + node)
    assert before is not None
    os.kill(before["pid"], signal.SIGKILL)
    for _ in range(100):
        if not Path(f"/proc/{before['edge_pid']}").exists():
            break
        await asyncio.sleep(0.05)
    assert not Path(f"/proc/{before['edge_pid']}").exists(), "the edge process outlived its actor"
    for _ in range(300):
        try:
            r = await (await c1.get(sb.id)).run("echo | nc -w 3 " + peer + " 8080", timeout_s=30)
            if "hello-peer" in r.stdout:
                break
        except DsecError:
            pass
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("the restarted edge did not serve its networked sandbox again")
    after = await actor_address(EDGE_PREFIX + node)
    assert after is not None and after["edge_pid"] != before["edge_pid"] and after["netns"] == before["netns"]
    for _ in range(300):           # the other replica finds the restarted edge too (discovery)
        try:
            if (await (await c0.get(sb.id)).run("echo via-0")).stdout == "via-0\n":
                break
        except DsecError:
            pass
        await asyncio.sleep(0.2)
    await (await c0.get(sb.id)).stop()


async def test_down_keeps_only_the_netns_with_a_plugged_sandbox(cluster, peer):
    """Last (it ends the cluster): `dsec cluster down` removes an edge's netns when nothing is
    plugged into its bridge, and keeps one whose sandbox would lose its network (the next `up`
    adopts it); local_cluster's teardown then removes that one too (the fixture checks)."""
    from dsec.cluster import netns
    from dsec.cluster import ray_cluster as rc
    c0 = cluster.clients[0]
    for sb in await c0.list():
        await (await c0.get(sb.id)).stop()
    keep = await c0.create_container(image="busybox", memory_mb=64, cpu_cores=0.1,
                                     network={"rules": [{"cidr": f"{peer}/32", "ports": [8080]}]})
    node = _node(keep)
    other = next(n for n in cluster.edges if n != node)
    await rc.down()
    assert Path(f"/run/netns/dsec-{node}").exists()
    assert netns.plugged_sandboxes(netns.EdgeNetns(node, "0.0.0.0/30"))
    assert netns.leftovers([other]) == []
