"""`dsec cluster up|down|status`: cluster mode on a running Ray cluster (ray_cluster.py).

Imports only typer at module level: the CLI loads this on a client-only install too; Ray and
the server side are imported when a command runs.
"""

from __future__ import annotations

import asyncio
import logging
import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from dsec.config import DEFAULT_HOME, DEFAULT_PORT

cluster_app = typer.Typer(no_args_is_help=True,
                          help="cluster mode on Ray: an edge per node, apiserver replicas (needs dsec-sandbox[cluster])")

Address = Annotated[str, typer.Option(help="the Ray cluster (ray.init address): 'auto' finds the local one")]


CLUSTER_INSTALL = "pip install 'dsec-sandbox[cluster]'"


def _connect(address: str) -> None:
    try:
        import ray
        import websockets  # noqa: F401  (the tunnel client of the replicas)
    except ImportError as e:
        typer.echo(f"error: cluster mode needs {e.name!r}, which is not installed\n  fix: {CLUSTER_INSTALL}", err=True)
        raise typer.Exit(2) from None
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)


def _print(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


@cluster_app.command("up")
def up(address: Address = "auto",
       replicas: Annotated[int, typer.Option(min=1, help="apiserver replicas")] = 2,
       port: Annotated[int, typer.Option(help="the replicas' API port (shared on a host)")] = DEFAULT_PORT,
       host: Annotated[str, typer.Option(help="the replicas' bind address; '' = their node's address")] = "",
       home: Annotated[Path, typer.Option(help="cluster state: secret, admin key, SQLite IAM")] = Path(DEFAULT_HOME) / "cluster",
       node_homes: Annotated[Path, typer.Option(help="each edge's DSEC_HOME is <node-homes>/<node id> on its node")
                             ] = Path(DEFAULT_HOME) / "nodes",
       db_url: Annotated[Optional[str], typer.Option(help="IAM database for every replica (PostgreSQL DSN); "
                                                          "default: DSEC_DB_URL")] = None,
       subnet_pool: str = "10.90.0.0/16", subnet_prefix: int = 22,
       node_resource: Annotated[Optional[str], typer.Option(help="only Ray nodes with this resource get an edge")] = None,
       builtin: Annotated[Optional[list[str]], typer.Option(help="built-in images each edge builds at start")] = None,
       share_hosts: Annotated[bool, typer.Option(help="N edges on one host each admit up to 1/N of it")] = True,
       node_cpu_cores: Annotated[Optional[float], typer.Option(help="CPU cores each edge counts as its node's "
                                                               "(default: its share of the host)")] = None,
       node_memory_mb: Annotated[Optional[int], typer.Option(help="memory (MiB) each edge counts as its node's "
                                                             "(default: its share of the host)")] = None,
       edge_netns: Annotated[Optional[bool], typer.Option(help="each edge in a network namespace of its own (Ray "
                                                          "nodes sharing one host, the replicas on it too); "
                                                          "default: DSEC_EDGE_NETNS")] = None,
       netns_pool: Annotated[str, typer.Option(help="the edges' netns links: a /30 each")] = "10.89.0.0/16",
       edge_port: Annotated[int, typer.Option(min=0, max=65535, help="every edge's service port (one edge per host "
                                              "address); 0: each keeps the free port it first bound")] = 0,
       edge_env: Annotated[Optional[list[str]], typer.Option(help="K=V in every edge's and replica's environment "
                                                             "(e.g. DSEC_LAYER_STORE=...); repeatable")] = None,
       edge_plain_http: Annotated[bool, typer.Option(help="replicas call edges over plain HTTP (bearer secret only; "
                                                     "a private network); default: TLS with the cluster CA")] = False,
       api_nodes: Annotated[Optional[str], typer.Option(help="replicas on these node names (a,b: one each, a stable "
                                                        "API address), or 'all' (one on every named node); "
                                                        "default: --replicas, spread")] = None,
       ) -> None:
    """Start an edge on every eligible Ray node and the apiserver replicas (what is missing)."""
    from dsec.cluster import ray_cluster as rc
    from dsec.settings import Settings
    conf = Settings.from_env().cluster      # this command's environment, read once
    env = _env_pairs(edge_env or [])
    _connect(address)
    settings = rc.ClusterSettings(home=home, node_homes=node_homes, db_url=db_url or conf.db_url, replicas=replicas,
                                  api_host=host, api_port=port, subnet_pool=subnet_pool, subnet_prefix=subnet_prefix,
                                  node_resource=node_resource, builtin_images=list(builtin or []),
                                  share_hosts=share_hosts, node_cpu_cores=node_cpu_cores,
                                  node_memory_mb=node_memory_mb, netns_pool=netns_pool,
                                  edge_netns=conf.edge_netns if edge_netns is None else edge_netns, edge_env=env,
                                  edge_port=edge_port, edge_tls=not edge_plain_http,
                                  api_nodes=[x.strip() for x in (api_nodes or "").split(",") if x.strip()])
    st = asyncio.run(rc.up(settings))
    _print(st)
    typer.echo(f"admin key: {settings.home / 'admin.key'}")
    stale = st.get("stale_homes") or {}
    for x in stale.get("cleared", []):       # stale_homes.py: what up destroyed, and where the files went
        typer.echo(f"warning: node {x['node']}'s home on {x['host']} was left under a stale identity: "
                   + (f"{len(x.get('stopped', []))} sandbox(es) destroyed, files moved to {x['moved_to']}"
                      if "moved_to" in x else f"not cleared ({x.get('skipped') or x.get('error')})"), err=True)
    for x in stale.get("kept", []):
        typer.echo(f"warning: node {x['node']}'s home {x['home']} on {x['host']} has no live raylet; "
                   f"{x['fix']}", err=True)


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k or not k.replace("_", "").isalnum():
            typer.echo(f"error: --edge-env {p!r} is not K=V\n  fix: e.g. --edge-env DSEC_LAYER_STORE=file:///srv/layers",
                       err=True)
            raise typer.Exit(2)
        out[k] = v
    return out


@cluster_app.command("node-resources")
def node_resources(node_name: Annotated[Optional[str], typer.Option(help="this node's name (default: the one kept "
                                                                         "in <node-homes>/node.name, made from the "
                                                                         "host name on first use)")] = None,
                   node_homes: Annotated[Path, typer.Option(help="where the host's edge homes (and node.name) live")
                                         ] = Path(DEFAULT_HOME) / "nodes") -> None:
    """Print `ray start --resources` for a raylet of this node: its dsec node name, which keeps
    the node (its home, subnet and sandboxes) across restarts of the raylet or the host."""
    from dsec.cluster.names import host_node_name, resources
    from dsec.types import DsecError
    try:
        typer.echo(resources(host_node_name(node_homes, node_name)))
    except DsecError as e:
        typer.echo(f"error: {e}" + (f"\n  fix: {e.fix}" if e.fix else ""), err=True)
        raise typer.Exit(2) from None


@cluster_app.command("status")
def status(address: Address = "auto") -> None:
    """Every edge (node, URL, alive) and apiserver replica of the cluster."""
    from dsec.cluster import ray_cluster as rc
    _connect(address)
    _print(asyncio.run(rc.status()))


@cluster_app.command("rotate-secret")
def rotate_secret(address: Address = "auto",
                  home: Annotated[Path, typer.Option(help="cluster state: secret, admin key, SQLite IAM")
                                  ] = Path(DEFAULT_HOME) / "cluster",
                  node_homes: Annotated[Path, typer.Option(help="where each node keeps its secret file")
                                        ] = Path(DEFAULT_HOME) / "nodes") -> None:
    """Replace the apiserver <-> edge secret on every live node, with no request refused."""
    from dsec.cluster import ray_cluster as rc
    _connect(address)
    _print(asyncio.run(rc.rotate_secret(rc.ClusterSettings(home=home, node_homes=node_homes))))


@cluster_app.command("down")
def down(address: Address = "auto") -> None:
    """Stop the replicas and edges (sandboxes keep running; the next `up` adopts them)."""
    from dsec.cluster import ray_cluster as rc
    _connect(address)
    _print({"stopped": asyncio.run(rc.down())})
