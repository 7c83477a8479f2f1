"""A real multi-node Ray cluster on this one machine, with dsec cluster mode up on it: what the
cluster tests and `dsec bench cluster` run. A head and `nodes - 1` more raylets
(ray.cluster_utils: each its own Ray node with its own processes), an edge per node in its own
home under `base`, replicas on the head. Torn down with everything the edges left (a killed
node's containers and mounts included).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("dsec.cluster.local")

# Ray declares a killed raylet dead within ~1.5 s instead of ~15 s
FAST_HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
               "RAY_health_check_initial_delay_ms": "0"}


@dataclass
class LocalCluster:
    ray_cluster: Any                    # ray.cluster_utils.Cluster
    settings: Any                       # ray_cluster.ClusterSettings
    replica_urls: list[str]
    admin_key: str
    nodes: dict[str, Any]               # dsec node id -> its ray_cluster node (None: the head)
    homes: list[Path] = field(default_factory=list)
    started_s: dict[str, float] = field(default_factory=dict)

    def kill_node(self, node_id: str) -> None:
        """SIGKILL the node's raylet (and so its workers: the edge)."""
        self.ray_cluster.remove_node(self.nodes.pop(node_id), False)

    def restart_node(self, node_id: str) -> None:
        """Start a raylet again under the name of a killed one (a new Ray node id): Ray starts
        the node's edge actor there, which adopts its sandboxes (a host's raylet restarted)."""
        assert node_id not in self.nodes, "kill it first"
        self.nodes[node_id] = self.ray_cluster.add_node(num_cpus=1, resources=_node_resources(node_id))


START_ATTEMPTS = 3


def _node_resources(name: str) -> dict[str, float]:
    from dsec.cluster.names import RESOURCE_PREFIX
    return {"dsec_edge": 1, RESOURCE_PREFIX + name: 1}


def _abandon(rcl: Any) -> None:
    """Shut a half-started local Ray cluster down, with the processes of a node whose start
    timed out (cluster_utils no longer tracks them): everything started for its session dir."""
    session = rcl.head_node.get_session_dir_path()
    rcl.shutdown()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if session.encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
    shutil.rmtree(session, ignore_errors=True)


def _seed_bin(base: Path) -> str:
    """The node's compiled helpers, built once here (not once per edge home, all on one host)."""
    from dsec.agent.build import agent_binary
    from dsec.settings import Settings
    node_bin = Settings.from_env().paths.bin
    seed = node_bin if any(node_bin.glob("dsec-nsexec-*")) else base / "bin"
    agent_binary(seed)
    return str(seed)


@asynccontextmanager
async def local_cluster(nodes: int = 3, replicas: int = 2, edge_env: dict[str, str] | None = None,
                        builtin_images: tuple[str, ...] = ("busybox",),
                        db_url: str | None = None, edge_netns: bool | None = None,
                        edge_tls: bool = True) -> AsyncIterator[LocalCluster]:
    """`db_url`: the replicas' control database (PostgreSQL DSN); None: one SQLite file.
    `edge_netns`: each edge in a network namespace of its own (D40); None: DSEC_EDGE_NETNS=1.
    `edge_tls`: replicas call edges over TLS (the cluster CA, cluster_ca.py)."""
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    from dsec.cluster import netns
    from dsec.cluster import ray_cluster as rc
    from dsec.cluster.discovery import EDGE_PREFIX, actor_address
    from dsec.settings import Settings
    from dsec.testing.isolated import cleanup_home

    conf = Settings.from_env()        # this process's, read once (a composition root)

    base = Path(tempfile.mkdtemp(prefix="dsec-cluster-", dir="/var/tmp"))
    saved = {k: os.environ.get(k) for k in FAST_HEALTH}
    os.environ.update(FAST_HEALTH)
    rcl = None
    clean = False
    homes: list[Path] = []
    node_ids: list[str] = []          # every Ray node's dsec id: whose netns the teardown removes
    try:
        t0 = time.monotonic()
        # the head hosts the replicas (dsec_api), every node an edge (dsec_edge)
        for attempt in range(START_ATTEMPTS):
            # node names unique on this host (bridges, netns, cgroups are host-wide): a prefix per try
            names = [f"t{secrets.token_hex(3)}-{i}" for i in range(nodes)]
            rcl = RayCluster(initialize_head=True, head_node_args={
                "num_cpus": 1, "resources": {**_node_resources(names[0]), "dsec_api": replicas},
                "include_dashboard": False})
            try:
                workers = [rcl.add_node(num_cpus=1, resources=_node_resources(n)) for n in names[1:]]
                break
            except Exception as exc:
                # Ray gives a raylet 30 s to register (hard-coded): a loaded host misses it.
                # Start over, leaving none of this try's processes behind.
                log.warning("a Ray node did not start in time; starting the cluster again", extra={"error": str(exc)})
                _abandon(rcl)
                rcl = None
                if attempt == START_ATTEMPTS - 1:
                    raise
        assert rcl is not None
        ray.init(address=rcl.address, log_to_driver=False, logging_level=logging.WARNING)
        t1 = time.monotonic()
        settings = rc.ClusterSettings(
            home=base / "cluster", node_homes=base / "nodes", replicas=replicas, api_host="127.0.0.1", api_port=0,
            subnet_pool=f"10.{90 + os.getpid() % 8}.0.0/16", subnet_prefix=24, node_resource="dsec_edge",
            api_resource="dsec_api", builtin_images=list(builtin_images), seed_bin=_seed_bin(base),
            db_url=db_url or conf.cluster.db_url,
            edge_netns=conf.cluster.edge_netns if edge_netns is None else edge_netns,
            netns_pool=f"10.{80 + os.getpid() % 8}.0.0/16", edge_tls=edge_tls,
            edge_env={"DSEC_VM": "0", "DSEC_LOG_LEVEL": "WARNING", **(edge_env or {})})
        if settings.edge_netns:
            node_ids = list(names)
        st = await rc.up(settings)
        homes = [Path(e["home"]) for e in st["edges"]]
        by_ray_id = {n.node_id: n for n in workers}
        node_map = {}
        for e in st["edges"]:
            a = await actor_address(EDGE_PREFIX + e["node_id"])
            assert a is not None
            node_map[e["node_id"]] = by_ray_id.get(a["ray_node"])
        key = (settings.home / "admin.key").read_text().strip()
        yield LocalCluster(rcl, settings, [r["url"] for r in st["replicas"]], key, node_map, homes,
                           {"ray_s": t1 - t0, "dsec_up_s": time.monotonic() - t1})
        await rc.down()
        clean = True
    finally:
        session = rcl.head_node.get_session_dir_path() if rcl is not None and rcl.head_node else None
        if ray.is_initialized():
            ray.shutdown()
        if rcl is not None:
            rcl.shutdown()
        if clean and session:        # Ray's logs stay only when something failed
            shutil.rmtree(session, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        leaked = [pid for h in homes for pid in cleanup_home(h)]    # the killed node's containers, mounts
        for node in node_ids:       # after the containers: nothing is plugged into a bridge in there
            netns.remove(node)
        shutil.rmtree(base, ignore_errors=True)
        if leaked:
            log.warning("killed leftover QEMUs of cluster homes", extra={"pids": leaked})
