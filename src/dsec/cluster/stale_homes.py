"""Edge homes left on a host under a stale identity, cleared at `cluster up` (issue 28.2;
docs/decisions.md, "Homes left under a stale identity").

Before D55 an edge's home and sandbox ids were named from its raylet's Ray node id
(`n` + 12 hex digits); a host upgraded from such a release, or whose node was forgotten (`dsec
nodes forget`) and renamed, still has `<node-homes>/<old>` with live sandboxes (containers,
mounts, cgroups, scratch, id ranges) that no replica routes to. Their ids name a node no edge
will serve again, so they are not adopted (an id cannot be re-homed: clients hold it); `up`
destroys them through a real edge on the old home, which knows how to take each one down:

- scan(), on each host (a Ray task pinned to one named raylet per host name): the homes under
  the root that no live raylet's name owns (nor `n<first 12 hex>` of a live raylet's Ray id:
  an older release's edge may still run there) and that no process serves (the server lock an
  edge holds for its lifetime, serverlock.py: several raylets of one host share the root);
- up decides from the control store (store/nodes.py): a name that never had a subnet there (an
  edge before D55) or that was forgotten is cleared; any other is a named node that is down
  (perhaps a raylet of this host restarting) and is only reported, with the commands
  (`dsec nodes forget <name>`, then `dsec cluster up`);
- clear(), on that host, holding the home's server lock throughout: `python -m
  dsec.cluster.stale_homes` (inside the node's netns if it had one) starts an edge on the home
  under the old name without a FnCall pool, stops every sandbox (live or parked) and closes;
  then the home's lxcfs is stopped, anything still mounted under it detached, its netns
  removed, and the home moved to <root>/.stale/<name>-<time> (snapshots and volume files
  stay there for the operator; nothing in it runs);
- up then releases the old node's quota reservations, ends its index rows as `forgotten` with
  a `node_lost` event each, and marks the name forgotten.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dsec.home_qemus import kill_qemus_of
from dsec.cluster.names import bridge_name, name_of
from dsec.config import Paths
from dsec.types import NODE_ID_RE, Conflict, DsecError

log = logging.getLogger("dsec.cluster.stale_homes")

HOME_MARKERS = ("edge.db", "crun", "sb")       # what only an edge's home holds
STALE_DIR = ".stale"                           # not a valid node name: never scanned again
CLEAR_TIMEOUT_S = 600.0
# the clearing edge's subnet when no sandbox of the home had an address: no bridge is made then
UNUSED_SUBNET = "169.254.252.0/24"
REASON = "its node's home was left under a stale identity (cleared by `dsec cluster up`)"


def scan(root: str, live: list[str]) -> list[str]:
    """On a host: names of the homes under `root` that no live name owns and no process serves."""
    from dsec.embedded.serverlock import serving_pid
    base = Path(root)
    if not base.is_dir():
        return []
    out = []
    for d in sorted(base.iterdir()):
        if d.name in live or not NODE_ID_RE.match(d.name) or d.is_symlink() or not d.is_dir():
            continue
        if any((d / m).exists() for m in HOME_MARKERS) and serving_pid(Paths(d)) is None:
            out.append(d.name)
    return out


def _subnet(home: Path, prefix: int) -> str:
    """The old edge's subnet, from an address its IPAM gave (network.py: net_sandboxes)."""
    try:
        db = sqlite3.connect(f"file:{home / 'edge.db'}?mode=ro", uri=True)
        try:
            row = db.execute("SELECT ip FROM net_sandboxes WHERE ip IS NOT NULL LIMIT 1").fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        row = None
    return str(ipaddress.ip_network(f"{row[0]}/{prefix}", strict=False)) if row else UNUSED_SUBNET


def clear(root: str, name: str, subnet_prefix: int, env: dict[str, str]) -> dict[str, Any]:
    """On the home's host: destroy what `<root>/<name>` runs (module doc). {node, stopped,
    moved_to}, or {node, skipped: why} / {node, error} (the home left as it was)."""
    from dsec.cluster import netns
    from dsec.embedded.serverlock import hold_server_lock
    home = Path(root) / name
    try:
        with hold_server_lock(Paths(home)):     # no edge starts on it meanwhile
            ns = netns.EdgeNetns(name, "0.0.0.0/30").path
            argv = [sys.executable, "-m", "dsec.cluster.stale_homes", str(home), name]
            if ns.exists():       # its bridge and veths live in there (D40)
                argv = ["nsenter", f"--net={ns}", "--", *argv]
            try:
                p = subprocess.run(argv, env={**os.environ, **env, "DSEC_HOME": str(home),
                                              "DSEC_NET_BRIDGE": bridge_name(name),
                                              "DSEC_NET_SUBNET": _subnet(home, subnet_prefix)},
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLEAR_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return {"node": name, "error": f"not cleared within {CLEAR_TIMEOUT_S:g} s (run `dsec cluster up` again)"}
            lines = p.stdout.strip().splitlines()
            if p.returncode != 0 or not lines:     # the home stays as it was: reported, `up` goes on
                log.error("clearing a stale home failed", extra={"home": str(home), "stderr": p.stderr[-2000:]})
                return {"node": name, "error": f"exit {p.returncode}: {p.stderr.strip()[-500:]}"}
            out: dict[str, Any] = json.loads(lines[-1])
            out["killed_qemu"] = kill_qemus_of(home)   # VMs of a home whose node had no VM backend now
            _detach(home)
            if ns.exists() or netns.leftovers([name]):
                netns.remove(name)
            dest = Path(root) / STALE_DIR / f"{name}-{int(time.time())}"
            dest.parent.mkdir(mode=0o700, exist_ok=True)
            os.rename(home, dest)
            out["moved_to"] = str(dest)
            return out
    except Conflict:
        return {"node": name, "skipped": "a process serves it (its server lock is held)"}


def _detach(home: Path) -> None:
    """The home's lxcfs (it outlives edges by design) and whatever is still mounted under it."""
    from dsec.embedded.server import stop_node_lxcfs
    stop_node_lxcfs(home)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f]
    under = [m for m in mounts if m == str(home) or m.startswith(str(home) + "/")]
    for m in sorted(under, key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)


async def _stop_all(name: str) -> dict[str, Any]:
    """In the child: an edge on the home (DSEC_HOME) as node `name`, every sandbox stopped."""
    from dsec.embedded.server import node_edge
    from dsec.settings import Settings
    stopped, failed = [], {}
    async with node_edge(Settings.from_env(), name) as edge:
        for info in await edge.list():
            try:
                await edge.stop(info.id, reason=REASON)
                stopped.append(info.id)
            except DsecError as e:
                failed[info.id] = e.message
    return {"node": name, "stopped": stopped, "failed": failed}


async def sweep(node_homes: Path, nodes: dict[str, dict[str, Any]], iam_url: str, admin_home: Path,
                subnet_prefix: int, env: dict[str, str], timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    """In `cluster up`: clear the stale homes on the hosts of these live named nodes (module
    doc). {"cleared": [...], "kept": [{node, host, fix}]}."""
    import ray
    alive = [n for n in await asyncio.to_thread(ray.nodes) if n.get("Alive")]
    live = {x for x in (name_of(n) for n in alive) if x} | {"n" + n["NodeID"][:12] for n in alive}
    hosts: dict[str, dict[str, Any]] = {}
    for n in sorted(nodes.values(), key=lambda n: n["NodeID"]):
        hosts.setdefault(str(n.get("NodeManagerHostname") or n.get("NodeManagerAddress")), n)
    found = await _on(scan, {h: (str(node_homes), sorted(live)) for h in hosts}, hosts, timeout_s)
    rows = await asyncio.to_thread(_rows, iam_url)
    out: dict[str, list[dict[str, Any]]] = {"cleared": [], "kept": []}
    todo: dict[str, list[str]] = {}
    for host, names in found.items():
        for name in names:
            row = rows.get(name)
            if row is None or row.subnet is None or row.state == "forgotten":
                todo.setdefault(host, []).append(name)
            else:
                fix = f"if node {name} will not come back: `dsec nodes forget {name}`, then `dsec cluster up` clears it"
                log.warning("a node's home on this host has no live raylet: left alone",
                            extra={"node": name, "host": host, "home": str(node_homes / name), "fix": fix})
                out["kept"].append({"node": name, "host": host, "home": str(node_homes / name), "fix": fix})
    for host, names in todo.items():      # one host's homes one after another (each starts an edge)
        for name in names:
            got = (await _on(clear, {host: (str(node_homes), name, subnet_prefix, env)}, hosts,
                             CLEAR_TIMEOUT_S + 60))[host]
            got["host"] = host
            if "skipped" not in got and "error" not in got:
                got.update(await asyncio.to_thread(_forget, iam_url, admin_home, name, host))
                log.warning("cleared a home left under a stale identity", extra=got)
            out["cleared"].append(got)
    return out


async def _on(fn: Any, args: dict[str, tuple[Any, ...]], hosts: dict[str, dict[str, Any]],
              timeout_s: float) -> dict[str, Any]:
    """{host: fn(*args[host])}, each run by a Ray task pinned to that host's raylet."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dsec.types import Unavailable
    task = ray.remote(fn)
    refs = {h: task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        hosts[h]["NodeID"], soft=False)).remote(*a) for h, a in args.items()}
    try:
        got = await asyncio.wait_for(asyncio.gather(*refs.values()), timeout_s)
    except (TimeoutError, ray.exceptions.RayError) as e:
        raise Unavailable(f"clearing stale edge homes failed ({type(e).__name__}: {e})", field="node_homes",
                          fix="see the Ray worker logs of the node; run `dsec cluster up` again") from None
    return dict(zip(refs, got))


def _rows(iam_url: str) -> dict[str, Any]:
    from dsec.store import open_db
    from dsec.store.nodes import NodeRegistry
    db = open_db(iam_url)
    try:
        return NodeRegistry(db).all()
    finally:
        db.close()


def _forget(iam_url: str, admin_home: Path, name: str, host: str) -> dict[str, int]:
    """The cleared node's quota back, its index rows ended (`forgotten`, with a node_lost event
    each), its name forgotten: as `dsec nodes forget` does."""
    from datetime import datetime, timezone

    from dsec.iam import IAM
    from dsec.store.events import EventStore
    from dsec.store.nodes import NodeRegistry
    from dsec.store.sandboxes import SandboxIndex
    from dsec.types import EventType, SandboxEvent
    iam = IAM(iam_url, home=admin_home)
    try:
        index = SandboxIndex(iam.db)
        rows = index.list(None, node=name)
        released = iam.quotas.release_node(name)
        ended = index.end_node(name, "forgotten")
        now = datetime.now(timezone.utc)
        events = EventStore(iam.db)
        for r in rows:
            events.add_once(SandboxEvent(type=EventType.ended, sandbox_id=r.id, project=r.project_id, node=name,
                                         reason="node_lost", infrastructure=True, at=now,
                                         message=f"node {name}'s home on {host} was left under a stale identity: "
                                                 "its sandboxes were destroyed by `dsec cluster up`"),
                            lambda p: iam.ancestors(p) or [p])
        NodeRegistry(iam.db).set_state(name, "forgotten")
        return {"released": released, "ended": ended}
    finally:
        iam.close()


def main() -> None:
    result = asyncio.run(_stop_all(sys.argv[2]))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
