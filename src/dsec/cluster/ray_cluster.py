"""`dsec cluster up/down/status` on a running Ray cluster (D32).

up: one EdgeNode per eligible live node that advertises a node name (names.py; detached, named
`dsec-edge-<name>`, placed by the name's Ray resource, so Ray starts it again wherever the name
comes back), each with its own DSEC_HOME, bridge and subnet (several Ray nodes may share a
host: CI, tests); then `replicas` ApiReplica actors spread over the nodes (or one pinned to each
of `api_nodes`: a stable API address). Idempotent: nodes
that already have an edge keep it (a node that is down too), new nodes get one; each name's
subnet is given once and kept in the control store (store/nodes.py). The cluster secret
(apiserver <-> edge authentication) is generated on the first `up` into <home>/cluster.secret
(0600) and reused after; every `up` installs it on every live Ray node as
<node-homes>/cluster.secret (secret_file.py), which that node's edges and replicas read: it is
never an actor argument. rotate_secret() replaces it on every live node without downtime.
Replicas reach edges over TLS: a cluster CA in <home>, each edge a certificate for its node name
(cluster_ca.py), installed by every `up`.

Node-global on one host, per edge: DSEC_HOME (edge.db, crun root, layer mounts, scratch),
bridge + nft table (named after the bridge) + subnet, the edge service's port (`edge_port`, else
a free one kept in its home, reported through Ray). Shared and safe to share: the cgroup tree /dsec/<sandbox id> (ids
carry the node), the uid-range registry in /run/dsec/idranges (host-wide by design), zram swap,
sysctls the edges set to the same values. Split between them: the host's CPU and memory, the
base of each edge's admission ceilings (share_env: 1/N each for N edges on one host).
With edge_netns (D40, netns.py) the bridge, nft table and sandbox veths of each edge live in
its own network namespace instead of beside the others'.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import secrets
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.cluster.discovery import API_PREFIX, EDGE_PREFIX, NAMESPACE, actor_address, live_names, named_actors
from dsec.cluster.cluster_ca import EDGE_TLS
from dsec.cluster.names import EDGE_SHARE, REPLICA_SHARE, RESOURCE_PREFIX, bridge_name, name_of
from dsec.config import DEFAULT_HOME, DEFAULT_PORT
from dsec.types import Conflict, InvalidArgument, Unavailable

log = logging.getLogger("dsec.cluster")

SECRET_FILE = "cluster.secret"
NODE_SECRET_FILE = "cluster.secret"      # in <node-homes> on every node (secret_file.py)
START_TIMEOUT_S = 120.0


@dataclass
class ClusterSettings:
    home: Path = Path(DEFAULT_HOME) / "cluster"      # secret, admin key, SQLite IAM (head node)
    node_homes: Path = Path(DEFAULT_HOME) / "nodes"  # each edge's DSEC_HOME: <node_homes>/<node id> on its node
    # IAM for every replica: DSEC_DB_URL (PostgreSQL) in a real cluster; else one SQLite file,
    # which only replicas on the head's host can share
    db_url: str | None = None       # the CLI gives DSEC_DB_URL
    replicas: int = 2
    api_host: str = ""              # "" = the replica's Ray node address
    api_port: int = DEFAULT_PORT    # replicas on one host share it (SO_REUSEPORT)
    subnet_pool: str = "10.90.0.0/16"
    subnet_prefix: int = 22         # per edge: 1,022 sandbox addresses
    node_resource: str | None = None   # only nodes offering this Ray resource get an edge
    api_resource: str | None = None    # replicas need one unit of this Ray resource (else: spread)
    builtin_images: list[str] = field(default_factory=list)
    edge_env: dict[str, str] = field(default_factory=dict)
    images_home: str | None = None  # replicas' image registry (tenancy checks) until the shared layer store
    seed_bin: str | None = None     # a bin/ of compiled helpers on every node's host to copy from (tests)
    # every edge's service port (firewalls); 0: each keeps the port it first bound (a free one) in
    # its home, so a restarted edge serves where it did (actors.edge_socket)
    edge_port: int = 0
    # N edges on one host (same hostname) each count 1/N of it (DSEC_NODE_SHARE, edge/node_share.py);
    # False: each counts the whole host (or its cgroup), overcommitting it N times
    share_hosts: bool = True
    node_cpu_cores: float | None = None   # every edge's CPU cores (DSEC_NODE_CPU_CORES); None: its share
    node_memory_mb: int | None = None     # every edge's memory (DSEC_NODE_MEMORY_MB); None: its share
    # each edge in a network namespace of its own, dsec-<node>, joined to its host by a veth on a
    # /30 of netns_pool (netns.py, D40); for Ray nodes sharing a host whose replicas run there too
    edge_netns: bool = False        # the CLI gives DSEC_EDGE_NETNS
    netns_pool: str = "10.89.0.0/16"
    # TLS between replicas and edges (cluster_ca.py): a CA in `home`, each edge a certificate for
    # its node name; False only by an explicit `--edge-plain-http` (a private network)
    edge_tls: bool = True
    # replicas only on these node names (each needs its `dsec_node:<name>` resource), one per name
    # and `replicas` ignored; ["all"]: one on every named live node; []: `replicas`, spread
    api_nodes: list[str] = field(default_factory=list)

    @property
    def iam_url(self) -> str:
        return self.db_url or str(self.home / "iam.db")


def _secret(home: Path) -> str:
    f = home / SECRET_FILE
    if f.exists():
        return f.read_text().strip()
    home.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(32)
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(value)
    return value


def _subnets(pool: str, prefix: int) -> list[str]:
    net = ipaddress.IPv4Network(pool)
    if prefix < net.prefixlen or prefix > 28:
        raise InvalidArgument(f"subnet_prefix /{prefix} does not fit the pool {pool}", field="subnet_prefix",
                              fix=f"use a prefix between /{net.prefixlen} and /28")
    return [str(s) for s in net.subnets(new_prefix=prefix)]


def share_env(settings: ClusterSettings, nodes: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Per Ray node id, the environment that sizes its edge's share of its host: 1/N for the N
    eligible nodes on one host (Ray nodes sharing a hostname: raylets started side by side),
    explicit amounts for every edge where set. The edge validates the values (node_share.py)."""
    for name, value in (("node_cpu_cores", settings.node_cpu_cores), ("node_memory_mb", settings.node_memory_mb)):
        if value is not None and not value > 0:      # the edge checks the rest against its host
            raise InvalidArgument(f"{name}={value} is not positive", field=name,
                                  fix=f"give a positive {name}, or leave it out for each edge's share of its host")

    def host(n: dict[str, Any]) -> str:   # a hostname, not an address: raylets in their own netns share it
        return str(n.get("NodeManagerHostname") or n.get("NodeManagerAddress", ""))

    per_host = Counter(host(n) for n in nodes)
    out = {}
    for n in nodes:
        env = {}
        k = per_host[host(n)]
        if settings.share_hosts and k > 1:
            env["DSEC_NODE_SHARE"] = f"1/{k}"
        if settings.node_cpu_cores is not None:
            env["DSEC_NODE_CPU_CORES"] = f"{settings.node_cpu_cores:g}"
        if settings.node_memory_mb is not None:
            env["DSEC_NODE_MEMORY_MB"] = str(settings.node_memory_mb)
        out[n["NodeID"]] = env
    return out


def _netns(settings: ClusterSettings, node: str, index: int) -> dict[str, str] | None:
    """The edge's own netns (its /30: the index-th, as its subnet is the index-th), if enabled."""
    if not settings.edge_netns:
        return None
    from dsec.cluster.netns import EdgeNetns, link_for
    return EdgeNetns(node, link_for(settings.netns_pool, index)).to_json()


def eligible_nodes(settings: ClusterSettings) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """({node name: its live Ray node}, [Ray ids of live eligible nodes that advertise no name]).
    A name offered by two live raylets is refused: both would claim one home and subnet."""
    import ray
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if settings.node_resource:
        nodes = [n for n in nodes if n.get("Resources", {}).get(settings.node_resource, 0) > 0]
    named: dict[str, dict[str, Any]] = {}
    unnamed = []
    for n in sorted(nodes, key=lambda n: n["NodeID"]):
        name = name_of(n)
        if name is None:
            unnamed.append(n["NodeID"])
        elif name in named:
            raise Conflict(f"two live Ray nodes advertise the node name {name!r} "
                           f"({named[name]['NodeManagerAddress']} and {n['NodeManagerAddress']})",
                           field="node_name", fix="give each raylet its own name: `ray start --resources "
                                                  "\"$(dsec cluster node-resources --node-name <name>)\"`")
        else:
            named[name] = n
    return named, unnamed


def _assign_subnets(settings: ClusterSettings, names: list[str], pool: list[str]) -> dict[str, str]:
    """Each node's subnet from the control store: the one it had, else a free one (kept)."""
    from dsec.store import open_db
    from dsec.store.nodes import NodeRegistry
    db = open_db(settings.iam_url)
    try:
        reg = NodeRegistry(db)
        out = {}
        for name in names:
            subnet = reg.assign_subnet(name, pool)
            if subnet is None:
                raise Unavailable(f"the subnet pool {settings.subnet_pool} has no /{settings.subnet_prefix} left",
                                  field="subnet_pool", fix="use a larger pool or a longer subnet_prefix, or "
                                                           "`dsec nodes forget` nodes gone for good")
            out[name] = subnet
        return out
    finally:
        db.close()


def _forgotten(settings: ClusterSettings, names: set[str]) -> set[str]:
    """Of these node names, those the control store has no row of (forgotten, or never up)."""
    from dsec.store import open_db
    from dsec.store.nodes import NodeRegistry
    db = open_db(settings.iam_url)
    try:
        rows = NodeRegistry(db).all()
        return {n for n in names if n not in rows or rows[n].state == "forgotten"}
    finally:
        db.close()


def _bootstrap_iam(settings: ClusterSettings) -> str:
    """The root project and admin key (once), and the `system` project's id (FnCall pools)."""
    from dsec.embedded.server import system_project
    from dsec.iam import IAM
    settings.home.mkdir(parents=True, exist_ok=True)
    iam = IAM(settings.iam_url, home=settings.home)
    try:
        iam.bootstrap(settings.home / "admin.key")
        return system_project(iam)
    finally:
        iam.close()


async def up(settings: ClusterSettings) -> dict[str, Any]:
    """Start what is missing; returns status(). Ray must be initialized (ray.init)."""
    import ray
    from dsec.cluster.actors import ApiReplica, EdgeNode

    secret = _secret(settings.home)
    secret_file = str(settings.node_homes / NODE_SECRET_FILE)
    await _install_secret(secret_file, [secret], keep_current=True)
    system = await asyncio.to_thread(_bootstrap_iam, settings)
    nodes, unnamed = await asyncio.to_thread(eligible_nodes, settings)
    for ray_id in unnamed:
        log.warning("a Ray node advertises no dsec node name: no edge there", extra={"ray_node": ray_id})
    if not nodes:
        raise Unavailable("no live Ray node is eligible for an edge"
                          + (f" ({len(unnamed)} advertise no dsec node name)" if unnamed else ""),
                          field="node_name" if unnamed else "node_resource",
                          fix="start each raylet with `ray start ... --resources \"$(dsec cluster node-resources)\"`"
                          + ("" if unnamed else ", or drop --node-resource"))
    placements = replica_placements(settings, set(nodes))     # a bad --api-nodes before anything starts
    # homes left on these hosts under a stale identity (an edge before D55, a forgotten name):
    # their sandboxes destroyed, before any new bridge could take their subnet (stale_homes.py)
    from dsec.cluster import stale_homes
    stale = await stale_homes.sweep(settings.node_homes, nodes, settings.iam_url, settings.home,
                                    settings.subnet_prefix, dict(settings.edge_env), START_TIMEOUT_S)
    existing = {n.removeprefix(EDGE_PREFIX) for n in await asyncio.to_thread(named_actors, EDGE_PREFIX)}
    # an edge whose node is down keeps its actor (Ray starts it again where its name comes back),
    # unless the node was forgotten (`dsec nodes forget`): then its name and subnet are free
    for node in await asyncio.to_thread(_forgotten, settings, existing - set(nodes)):
        await asyncio.to_thread(_kill, EDGE_PREFIX + node)
        existing.discard(node)
    pool = _subnets(settings.subnet_pool, settings.subnet_prefix)
    subnets = await asyncio.to_thread(_assign_subnets, settings, sorted(nodes), pool)
    ca_file = await _install_tls(settings, nodes, {n: _netns(settings, n, pool.index(subnets[n])) for n in nodes}) \
        if settings.edge_tls else None
    edge_cls = ray.remote(EdgeNode)
    shares = share_env(settings, list(nodes.values()))
    started = []
    for node, n in nodes.items():
        if node in existing:
            continue
        subnet = subnets[node]
        home = settings.node_homes / node
        env = {**shares[n["NodeID"]], **settings.edge_env, "DSEC_HOME": str(home),
               "DSEC_NET_BRIDGE": bridge_name(node), "DSEC_NET_SUBNET": subnet}
        # placed by its name's resource, not pinned to a Ray node id: Ray starts it again on
        # the raylet that offers the name next (the same host after a restart: it adopts)
        edge_cls.options(name=EDGE_PREFIX + node, namespace=NAMESPACE, lifetime="detached", num_cpus=0,
                         max_restarts=-1, max_concurrency=10_000, resources={RESOURCE_PREFIX + node: EDGE_SHARE},
                         runtime_env={"env_vars": env}).remote(
            node, str(home), secret_file, system, "", settings.builtin_images, settings.seed_bin,
            _netns(settings, node, pool.index(subnet)), settings.edge_port,
            str(home / EDGE_TLS) if settings.edge_tls else None)
        started.append(node)
    # every edge answers (starts) before the replicas look for them
    answers = await asyncio.gather(*(actor_address(EDGE_PREFIX + n, START_TIMEOUT_S) for n in started))
    failed = [n for n, a in zip(started, answers) if a is None]
    if failed:
        raise Unavailable(f"edges did not start on {', '.join(failed)}", field="nodes",
                          fix="see the Ray worker logs of those nodes (/tmp/ray/session_latest/logs)")
    replica_cls = ray.remote(ApiReplica)
    have = set(await asyncio.to_thread(named_actors, API_PREFIX))
    new_replicas = []
    for name, placement in placements.items():
        if name in have:
            continue
        replica_cls.options(name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=-1,
                            max_concurrency=10_000, **placement,
                            runtime_env={"env_vars": dict(settings.edge_env)}).remote(
            name, secret_file, settings.iam_url, str(settings.home / "admin.key"), settings.api_host,
            settings.api_port, settings.images_home, ca_file)
        new_replicas.append(name)
    answers = await asyncio.gather(*(actor_address(n, START_TIMEOUT_S) for n in new_replicas))
    if any(a is None for a in answers):
        raise Unavailable("an apiserver replica did not start", field="replicas",
                          fix="see the Ray worker logs (/tmp/ray/session_latest/logs)")
    st = await status()
    if stale["cleared"] or stale["kept"]:
        st["stale_homes"] = stale
    if unnamed:      # the operator sees which raylets got no edge, and how to name them
        st["unnamed_ray_nodes"] = {"ray_node_ids": unnamed, "fix": "ray start ... --resources "
                                   "\"$(dsec cluster node-resources --node-name <name>)\""}
    return st


async def _install_tls(settings: ClusterSettings, nodes: dict[str, dict[str, Any]],
                       netns: dict[str, dict[str, str] | None]) -> str:
    """The cluster CA on every live node (<node-homes>/cluster-ca.pem, what replicas verify
    with) and a fresh certificate for each named node's edge, for its name and the addresses it
    is known by (<node-homes>/<name>/edge-tls.pem, 0600). Returns the CA file's path."""
    import ray
    from dsec.cluster import cluster_ca
    from dsec.cluster.netns import EdgeNetns
    ca_file = str(settings.node_homes / cluster_ca.CA_CERT)
    ca = await asyncio.to_thread(cluster_ca.ca_pem, settings.home)
    files: dict[str, list[tuple[str, bytes, int]]] = {
        n["NodeID"]: [(ca_file, ca, 0o644)] for n in await asyncio.to_thread(ray.nodes) if n.get("Alive")}
    for name, n in nodes.items():
        addresses = [str(n.get("NodeManagerAddress") or "")]
        if netns.get(name):
            addresses.append(EdgeNetns.from_json(netns[name]).ns_ip)   # type: ignore[arg-type]
        pem = await asyncio.to_thread(cluster_ca.issue, settings.home, name, addresses)
        files.setdefault(n["NodeID"], []).append((str(settings.node_homes / name / cluster_ca.EDGE_TLS), pem, 0o600))
    await _on_nodes(_write_files, {node: (f,) for node, f in files.items()}, "the cluster TLS files")
    return ca_file


def _write_files(files: list[tuple[str, bytes, int]]) -> None:
    """On a node (a Ray task pinned there): each (path, content, mode), atomically."""
    from dsec.cluster.cluster_ca import install
    for path, data, mode in files:
        install(path, data, mode)


async def _on_nodes(fn: Any, args: dict[str, tuple[Any, ...]], what: str) -> None:
    """fn(*args[node]) on each Ray node id given, by a task pinned there."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    task = ray.remote(fn)
    refs = [task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(*a)
            for n, a in args.items()]
    try:
        await asyncio.wait_for(asyncio.gather(*refs), START_TIMEOUT_S)
    except (TimeoutError, ray.exceptions.RayError) as e:
        raise Unavailable(f"{what} could not be written on every live node ({type(e).__name__}: {e})",
                          field="nodes", fix="see `ray status`; run the command again") from None


PINNED = "on-"      # dsec-api-on-<node>: a replica pinned to a node (never a number: dsec-api-<i>)


def replica_placements(settings: ClusterSettings, live: set[str]) -> dict[str, dict[str, Any]]:
    """{replica actor name: its Ray placement options}. With api_nodes, one replica per named
    node, needing that name's resource: Ray starts it there again after a crash or a restart
    of the node's raylet, so the node's address stays an API address (a load balancer's
    backend). Else `replicas` of them, spread (or on `api_resource`)."""
    if settings.api_nodes:
        if settings.api_nodes == ["all"]:
            wanted = sorted(live)
        else:
            from dsec.cluster.names import check_name
            wanted = [check_name(n, field="api_nodes") for n in settings.api_nodes]
            missing = [n for n in wanted if n not in live]
            if missing:
                raise InvalidArgument(f"--api-nodes names {', '.join(missing)}: no live Ray node offers "
                                      f"{'that name' if len(missing) == 1 else 'those names'}", field="api_nodes",
                                      fix=f"live node names: {', '.join(sorted(live)) or 'none'}; or --api-nodes all")
        return {f"{API_PREFIX}{PINNED}{n}": {"resources": {RESOURCE_PREFIX + n: REPLICA_SHARE}} for n in wanted}
    return {f"{API_PREFIX}{i}": ({"resources": {settings.api_resource: 1}} if settings.api_resource
                                 else {"scheduling_strategy": "SPREAD"}) for i in range(settings.replicas)}


def _write_secret(path: str, lines: list[str], keep_current: bool) -> None:
    """On a node (a Ray task pinned there): its secret file becomes `lines`; with keep_current,
    left as it is when it already sends lines[0] (a rotation's later steps are not undone)."""
    from dsec.cluster.secret_file import SecretFile, install
    if keep_current:
        try:
            if SecretFile(path).current() == lines[0]:
                return
        except Exception:
            pass
    install(path, lines)


async def _install_secret(path: str, lines: list[str], keep_current: bool = False) -> int:
    """Write the secret file on every live Ray node (each by a task pinned to it); how many."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    task = ray.remote(_write_secret)
    nodes = [n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n.get("Alive")]
    refs = [task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
        path, lines, keep_current) for n in nodes]
    try:
        await asyncio.wait_for(asyncio.gather(*refs), START_TIMEOUT_S)
    except (TimeoutError, ray.exceptions.RayError) as e:
        raise Unavailable(f"the cluster secret could not be written on every live node ({type(e).__name__}: {e})",
                          field="secret", fix="see `ray status`; run the command again") from None
    return len(nodes)


ROTATE_SETTLE_S = 2.0     # requests signed with the old secret just before the switch still land


async def rotate_secret(settings: ClusterSettings) -> dict[str, Any]:
    """A new cluster secret without downtime: every live node accepts both, then sends the new
    one, then accepts only it. A node down meanwhile gets it from the next `up`."""
    from dsec.cluster.secret_file import install
    old = _secret(settings.home)
    new = secrets.token_urlsafe(32)
    path = str(settings.node_homes / NODE_SECRET_FILE)
    await _install_secret(path, [old, new])          # edges accept both; replicas still send the old
    await _install_secret(path, [new, old])          # replicas send the new one
    await asyncio.to_thread(install, settings.home / SECRET_FILE, [new])
    await asyncio.sleep(ROTATE_SETTLE_S)
    n = await _install_secret(path, [new])           # the old one is refused from now on
    log.info("cluster secret rotated", extra={"nodes": n})
    return {"rotated": True, "nodes": n, "file": path}


async def status() -> dict[str, Any]:
    """{"edges": [...], "replicas": [...]}: each actor's address, plus each edge's health."""
    import ray
    alive = {n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n.get("Alive")}
    edges = []
    live = await asyncio.to_thread(live_edge_ids)
    for name in await asyncio.to_thread(named_actors, EDGE_PREFIX):
        a = await actor_address(name, 10) if name.removeprefix(EDGE_PREFIX) in live else None
        edges.append({"node_id": name.removeprefix(EDGE_PREFIX), "url": a and a["url"],
                      "alive": a is not None and a["ray_node"] in alive, "home": a and a["home"],
                      "subnet": a and a.get("subnet"), "netns": a and a.get("netns")})
    replicas = []
    for name in await asyncio.to_thread(named_actors, API_PREFIX):
        a = await actor_address(name, 10)
        replicas.append({"name": name, "url": a and a["url"], "alive": a is not None and a["ray_node"] in alive})
    return {"edges": edges, "replicas": replicas}


def live_edge_ids() -> set[str]:
    """The dsec node names live Ray nodes offer (an edge of any other name is down with its node)."""
    return set(live_names())


def _kill(name: str) -> bool:
    import ray
    try:
        ray.kill(ray.get_actor(name, NAMESPACE), no_restart=True)
        return True
    except ValueError:      # gone already
        return False


async def down() -> list[str]:
    """Stop the replicas, then the edges (sandboxes keep running on their nodes, as with
    `dsec down`; an edge started again on the same home adopts them). Returns the actors ended."""
    import ray
    ended = []
    live = await asyncio.to_thread(live_edge_ids)
    for prefix in (API_PREFIX, EDGE_PREFIX):
        for name in await asyncio.to_thread(named_actors, prefix):
            if prefix == EDGE_PREFIX and name.removeprefix(EDGE_PREFIX) not in live:
                if await asyncio.to_thread(_kill, name):     # its node is dead: nothing to stop
                    ended.append(name)
                continue
            try:
                handle = await asyncio.to_thread(ray.get_actor, name, NAMESPACE)
            except ValueError:
                continue
            try:
                await asyncio.wait_for(handle.stop.remote(), 60)
            except (TimeoutError, ray.exceptions.RayError) as e:
                log.warning("cluster actor did not stop cleanly", extra={"actor": name, "error": str(e)})
            ray.kill(handle, no_restart=True)
            ended.append(name)
    return ended
