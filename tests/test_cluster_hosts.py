"""The three-hosts proof of issue 28: cluster mode on three "hosts" that share nothing but a
network, then a host's processes killed and started again, a host removed for good, a host cut
off, and the control store stopped.

Each host is a network namespace with its own address on a bridge (`ip netns`), its own raylet
(`ray start` inside it; the first is the Ray head) and so its own edge and apiserver replica
(`cluster up --api-nodes`: one pinned to each of the first two hosts); PostgreSQL runs in a
fourth. Nothing crosses on loopback: Ray, the replicas -> edges (TLS, the cluster CA), the
replicas -> PostgreSQL and this test -> the replicas all go over the bridge (this test is the
bridge's own address: an operator's machine). Then, in order:
1. host c's processes are all killed (its raylet, workers, edge: every process in its netns;
   its sandboxes are in netns of their own and live on) and started again under the same node
   name: the edge comes back there, adopts its sandboxes (same ids, they answer, `stop` works);
2. host b is removed for good: killed, then `dsec nodes forget b`: its sandboxes' quota is
   released;
3. host c is cut off the bridge: a listing through host a names it unreachable (its sandboxes
   shown as last known) and host a's sandboxes answer meanwhile;
4. PostgreSQL is stopped for STORE_DOWN_S: host a's sandboxes keep answering; after its
   return a create succeeds (the SDK waits out the 503s).
Marked `hosts` (about 2.5 minutes on the loaded 2-core box, beside the session's image
builds); skipped without root, ip, ray or PostgreSQL. DSEC_KEEP_HOSTS=1 keeps the Ray logs of a
failed run in its /var/tmp/dsec-hosts-* dir (everything else is removed).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import NO_PSI_ADMISSION, requires_root

from dsec import Client
from dsec.testing.postgres import PostgresCluster, pg_bindir

pytest.importorskip("ray", reason="cluster mode needs ray: pip install -e '.[cluster]'")

pytestmark = pytest.mark.hosts

STORE_DOWN_S = 20
TAG = f"{os.getpid() % 10000:04d}"
NET = f"10.71.{20 + os.getpid() % 200}"
HOSTS = {"a": 11, "b": 12, "c": 13}
PG_HOST = "p"
PG_IP = f"{NET}.20"
BRIDGE = f"d28b{TAG}"
API_PORT, EDGE_PORT = 7620, 7700
RAY_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5",
           "RAY_health_check_initial_delay_ms": "0", "RAY_USAGE_STATS_ENABLED": "0"}
SRC = str(Path(__import__("dsec").__file__).resolve().parents[1])


EDGE_ERROR = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
try:
    print(ray.get(ray.get_actor(sys.argv[2], namespace="dsec").address.remote(), timeout=60))
except Exception as e:
    print(type(e).__name__, e)
"""


def _ns(h: str) -> str:
    return f"d28{TAG}{h}"


def _in(h: str) -> list[str]:
    """Run in the host's network namespace only (`ip netns exec` would also mount a sysfs of
    its own over /sys, hiding the cgroup tree the edge needs)."""
    return ["nsenter", f"--net=/run/netns/{_ns(h)}", "--"]


def _node(h: str) -> str:
    return f"p{TAG}{h}"


def _ip(h: str) -> str:
    return f"{NET}.{HOSTS[h]}"


def _sh(*argv: str, check: bool = True, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr[:4000]}\n...\n"
                           f"{p.stderr[-1500:]}{p.stdout[-1000:]}")
    return p


def _add_host(h: str, ip: str) -> None:
    ns, outside, inside = _ns(h), f"d28v{TAG}{h}", f"d28n{TAG}{h}"
    _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
    _sh("ip", "link", "set", inside, "netns", ns)
    _sh("ip", "link", "set", outside, "master", BRIDGE, "up")
    for cmd in (["link", "set", "lo", "up"], ["link", "set", inside, "name", "eth0"],
                ["addr", "add", f"{ip}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                ["route", "add", "default", "via", f"{NET}.1"]):
        _sh("ip", "-n", ns, *cmd)


def _link(h: str, up: bool) -> None:
    _sh("ip", "link", "set", f"d28v{TAG}{h}", "up" if up else "down")


def _kill_host(h: str) -> int:
    """SIGKILL every process in the host's netns (a host crash, less its sandboxes: they are in
    network namespaces of their own)."""
    pids = _sh("ip", "netns", "pids", _ns(h), check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


class NetnsPostgres(PostgresCluster):
    """PostgreSQL served on its own host's address (a netns on the bridge), trusting the net."""

    def __init__(self) -> None:
        super().__init__()
        self.port = 5432
        self.dsn = f"postgresql://dsec@{PG_IP}:5432/postgres"
        with open(self.data / "pg_hba.conf", "a") as f:
            f.write(f"host all all {NET}.0/24 trust\n")

    def start(self) -> None:
        opts = (f"-p {self.port} -k {self.dir} -c listen_addresses={PG_IP} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        cmd = [*_in(PG_HOST), "runuser", "-u", "postgres", "--", str(self.bindir / "pg_ctl"),
               "-D", str(self.data), "-o", opts, "-l", str(self.dir / "server.log"), "-w", "-t", "60", "start"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.dir)
        if p.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {p.stderr[-2000:]}\n{self.log_tail()}")


class Hosts:
    def __init__(self, base: Path):
        self.base = base
        self.ray = str(Path(sys.executable).parent / "ray")
        self.env = {**os.environ, **RAY_ENV, "PYTHONPATH": SRC}
        self.pg: NetnsPostgres | None = None
        self.key = ""
        self.up = lambda: ""

    def ray_start(self, h: str, attempts: int = 3) -> None:
        """`ray start` on the host; Ray gives a raylet 30 s to register (hard-coded), which a
        loaded box can miss: then that host's processes are killed and it is started again."""
        for attempt in range(attempts):
            try:
                return self._ray_start(h)
            except RuntimeError as e:
                if attempt == attempts - 1:
                    raise
                print(f"ray start on {h} failed, again: {str(e)[-300:]}")
                _kill_host(h)

    def _ray_start(self, h: str) -> None:
        res = json.dumps({f"dsec_node:{_node(h)}": 1})
        where = ["--head", "--port", "6379", "--temp-dir", str(self.base / "ray"), "--include-dashboard=false"] \
            if h == "a" else ["--address", f"{_ip('a')}:6379"]
        _sh(*_in(h), self.ray, "start", *where, "--node-ip-address", _ip(h),
            "--num-cpus", "1", "--resources", res, "--disable-usage-stats",
            env=self.env)

    def dsec(self, *args: str, host: str = "a", timeout: float = 600) -> str:
        """`python -m dsec ...` as a Ray driver on a host (Ray wants its drivers beside a raylet)."""
        return _sh(*_in(host), sys.executable, "-m", "dsec", *args,
                   env=self.env, timeout=timeout).stdout

    def api(self, h: str) -> str:
        return f"http://{_ip(h)}:{API_PORT}"


def _seed_homes(node_homes: Path, dsec_home: Path) -> None:
    """Each node's compiled helpers and busybox image, built once (the session's) rather than by
    each of three edges on a loaded box: the layer files shared, the image records copied."""
    import sqlite3

    from dsec.cluster.actors import seed_native_helpers
    from dsec.cluster.local import _seed_bin
    from dsec.config import Paths
    seed = Path(_seed_bin(node_homes.parent))
    for h in HOSTS:
        home = node_homes / _node(h)
        home.mkdir(parents=True)
        seed_native_helpers(seed, Paths(home).bin)
        (home / "store").symlink_to(dsec_home / "store")
        with sqlite3.connect(dsec_home / "images.db") as src, sqlite3.connect(home / "images.db") as dst:
            src.backup(dst)


@pytest.fixture(scope="module")
def hosts(dsec_home, images):
    requires_root()
    for tool in ("ip", "runuser"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    if pg_bindir() is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not installed: scripts/install-extras.sh cluster")
    base = Path(tempfile.mkdtemp(prefix="dsec-hosts-", dir="/var/tmp"))
    w = Hosts(base)
    try:
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "addr", "add", f"{NET}.1/24", "dev", BRIDGE)
        _sh("ip", "link", "set", BRIDGE, "up")
        for h in HOSTS:
            _add_host(h, _ip(h))
        _add_host(PG_HOST, PG_IP)
        w.pg = NetnsPostgres()
        w.pg.start()
        import psycopg
        with psycopg.connect(w.pg.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE hosts")
        t0 = time.monotonic()
        for h in HOSTS:
            w.ray_start(h)
        print(f"three raylets in {time.monotonic() - t0:.1f}s")
        _seed_homes(base / "nodes", dsec_home)
        edge_env = {**NO_PSI_ADMISSION, "DSEC_VM": "0", "DSEC_LOG_LEVEL": "WARNING"}
        w.up = lambda: w.dsec("cluster", "up", "--address", f"{_ip('a')}:6379", "--home", str(base / "cluster"),
               "--node-homes", str(base / "nodes"), "--db-url", f"postgresql://dsec@{PG_IP}:5432/hosts",
               "--api-nodes", f"{_node('a')},{_node('b')}", "--port", str(API_PORT), "--edge-port", str(EDGE_PORT),
               "--builtin", "busybox", "--subnet-prefix", "24",
               *(x for k, v in edge_env.items() for x in ("--edge-env", f"{k}={v}")))
        try:
            w.up()
        except RuntimeError as e:      # why an edge did not start: its address() call's error
            why = _sh(*_in("a"), sys.executable, "-c", EDGE_ERROR, f"{_ip('a')}:6379",
                      f"dsec-edge-{_node('a')}", env=w.env, check=False)
            raise RuntimeError(f"{e}\nedge a: {why.stdout[-3000:]}{why.stderr[-1500:]}") from None
        print(f"three hosts up in {time.monotonic() - t0:.1f}s")
        w.key = (base / "cluster" / "admin.key").read_text().strip()
        yield w
    finally:
        from dsec.cluster import netns
        from dsec.testing.isolated import cleanup_home
        for h in HOSTS:
            _kill_host(h)
        if w.pg is not None:
            w.pg.destroy()
        for h in HOSTS:
            cleanup_home(base / "nodes" / _node(h))
            netns.remove(_node(h))        # none made (the edges run in their host's netns): harmless
        for h in [*HOSTS, PG_HOST]:
            _sh("ip", "netns", "del", _ns(h), check=False)
            _sh("ip", "link", "del", f"d28v{TAG}{h}", check=False)
        _sh("ip", "link", "del", BRIDGE, check=False)
        if not os.environ.get("DSEC_KEEP_HOSTS"):       # a failure to look into: its Ray logs
            shutil.rmtree(base, ignore_errors=True)


async def _until(what: str, check, timeout_s: float = 120, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            got = await check()
            if got:
                return got
            last = got
        except Exception as e:        # the thing is still coming back: keep asking
            last = e
        await asyncio.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s}s (last: {last!r})")


def _on(sb_id: str) -> str:
    return sb_id.removeprefix("sb-").split(".")[0]


async def test_three_hosts(hosts):
    w = hosts
    a, b, c = (_node(h) for h in HOSTS)
    async with Client(w.api("a"), w.key) as api, Client(w.api("b"), w.key) as api_b:
        # the pinned replicas: one on a, one on b, each at its host's address
        assert (await api_b.nodes()) and {n.node_id for n in await api.nodes()} == {a, b, c}
        root = (await api.projects())[0].id
        per: dict[str, list] = {a: [], b: [], c: []}
        for _ in range(15):                   # power-of-two placement: every host gets some
            sb = await api.create_container(image="busybox", memory_mb=32, cpu_cores=0.1)
            per[_on(sb.id)].append(sb)
            if all(len(v) >= 1 for v in per.values()) and sum(map(len, per.values())) >= 5:
                break
        assert all(per.values()), {k: len(v) for k, v in per.items()}
        for node, sbs in per.items():
            for sb in sbs:
                assert (await sb.run(f"echo {node} > /tmp/who && cat /tmp/who")).stdout == f"{node}\n"

        # 1. host c: every process killed, then its raylet started again under its name
        t0 = time.monotonic()
        assert _kill_host("c") > 0
        await asyncio.to_thread(w.ray_start, "c")

        async def c_adopted() -> bool:
            for sb in per[c]:
                back = await api.get(sb.id)
                if (await back.run("cat /tmp/who")).stdout != f"{c}\n":
                    return False
            return True
        await _until("host c's sandboxes answer again after its restart", c_adopted, 180)
        print(f"host c killed and started again: its sandboxes answer after {time.monotonic() - t0:.1f}s")

        # 2. host b removed for good: its quota released by `forget`
        used = (await api.quota(root)).used.sandboxes
        _kill_host("b")
        forgot = await _until("forget b (refused while it answers)",
                              lambda: api.node_action(b, "forget"), 120, 1.0)
        print("forget:", forgot)
        assert (await api.quota(root)).used.sandboxes == used - len(per[b])
        assert b not in {n.node_id for n in await api.nodes() if n.healthy}

        # 3. host c cut off the bridge: named unreachable, host a unaffected
        _link("c", False)
        try:
            listing = await _until("c named unreachable", lambda: _unreachable(api, c), 60)
            assert {s.id for s in per[c]} <= {s.id for s in listing.sandboxes}       # as last known
            for sb in per[a]:
                assert (await sb.run("cat /tmp/who")).stdout == f"{a}\n"
        finally:
            _link("c", True)

        # 4. PostgreSQL stopped: host a's sandboxes keep answering through the outage
        assert w.pg is not None
        w.pg.stop()
        try:
            t0, worst = time.monotonic(), 0.0
            while time.monotonic() - t0 < STORE_DOWN_S:
                for sb in per[a]:
                    t1 = time.monotonic()
                    assert (await sb.run("cat /tmp/who")).stdout == f"{a}\n"
                    worst = max(worst, time.monotonic() - t1)
                await asyncio.sleep(0.5)
            print(f"store down {STORE_DOWN_S}s: commands answered, slowest {worst:.2f}s")
        finally:
            w.pg.start()
        fresh = await api.create_container(image="busybox", memory_mb=32, cpu_cores=0.1)
        assert (await fresh.run("echo back")).stdout == "back\n"
        for sb in [fresh, *per[a]]:
            await sb.stop()
        async with httpx.AsyncClient(timeout=10) as http:       # the stable address: a's replica
            assert (await http.get(w.api("a") + "/healthz")).status_code == 200


async def _unreachable(api: Client, node: str):
    listing = await api.listing()
    return listing if node in listing.unreachable_nodes else None
