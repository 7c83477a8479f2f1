"""Which edges an apiserver replica talks to: Ray's named edge actors on live nodes.

Every `interval_s` the replica lists the cluster's EdgeNode actors (ray_cluster.EDGE_PREFIX in
NAMESPACE, one per node name: names.py), asks each new one for its address, and drops the edges
whose name no live Ray node offers (Ray's own health checks) or whose actor is gone; a name
offered again (a raylet started again) is asked again: Ray restarted its edge actor there. The mappings it keeps (`edges`,
`fncall`) are the ApiContext's: apiserver routes see a node appear or leave without restart.
The watcher gets the same edges and polls them over HTTP for health and load; it marks a dead
edge unhealthy within a poll, before Ray declares its node dead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, ItemsView, Iterator, KeysView, Mapping, ValuesView
from typing import Any, Generic, TypeVar

from dsec.cluster.cluster_ca import client_context
from dsec.cluster.edge_client import HttpEdge, HttpFnCall
from dsec.cluster.names import name_of
from dsec.types import DsecError
from dsec.watcher import Watcher

log = logging.getLogger("dsec.cluster.discovery")

NAMESPACE = "dsec"
EDGE_PREFIX = "dsec-edge-"
API_PREFIX = "dsec-api-"
ADDRESS_TIMEOUT_S = 30.0     # a new edge's first address() also starts it (image builds, recovery)
RESTART_TIMEOUT_S = 5.0      # asking an unhealthy edge again must not stall discovery for long


def live_names() -> dict[str, str]:
    """{dsec node name: Ray node id} of the live Ray nodes that advertise a name (names.py).
    A name on two live raylets (a misconfiguration `cluster up` refuses) maps to the first."""
    import ray
    out: dict[str, str] = {}
    for n in sorted(ray.nodes(), key=lambda n: n["NodeID"]):
        name = name_of(n) if n.get("Alive") else None
        if name is not None:
            out.setdefault(name, n["NodeID"])
    return out


def named_actors(prefix: str) -> list[str]:
    import ray
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix))


async def actor_address(name: str, timeout_s: float = ADDRESS_TIMEOUT_S) -> dict[str, Any] | None:
    """The actor's address() answer, or None if it is gone or does not answer in time."""
    import ray
    try:
        handle = await asyncio.to_thread(ray.get_actor, name, NAMESPACE)
        return await asyncio.wait_for(handle.address.remote(), timeout_s)
    except (ValueError, TimeoutError, ray.exceptions.RayError) as e:
        log.warning("cluster actor did not answer", extra={"actor": name, "error": f"{type(e).__name__}: {e}"})
        return None


T = TypeVar("T")


class LiveMap(Mapping[str, T], Generic[T]):
    """A mapping discovery changes while requests iterate it (`for edge in ctx.edges.values()`
    around awaits): every change replaces the inner dict (copy on write), so an iteration that
    started goes on over the snapshot it began with, never "dict changed size"."""

    def __init__(self) -> None:
        self._d: dict[str, T] = {}

    def __getitem__(self, key: str) -> T:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def keys(self) -> KeysView[str]:
        return self._d.keys()

    def values(self) -> ValuesView[T]:
        return self._d.values()

    def items(self) -> ItemsView[str, T]:
        return self._d.items()

    def set(self, key: str, value: T) -> None:
        self._d = {**self._d, key: value}

    def pop(self, key: str) -> T | None:
        if key not in self._d:
            return None
        d = dict(self._d)
        value = d.pop(key)
        self._d = d
        return value


class RayDiscovery:
    def __init__(self, watcher: Watcher, secret: str | Callable[[], str], interval_s: float = 1.0,
                 ca_file: str | None = None):
        """`ca_file`: the cluster CA; with it, only edges serving TLS that it verifies are used
        (an edge on plain HTTP is refused: TLS is off only where `cluster up` said so)."""
        self.watcher = watcher
        self._ca_file = ca_file
        self._tls = client_context(ca_file) if ca_file else None
        self._refused: set[tuple[str, str]] = set()     # (node, url) logged once
        self.interval_s = interval_s
        self._secret = secret
        self.edges: LiveMap[HttpEdge] = LiveMap()
        self.fncall: LiveMap[HttpFnCall] = LiveMap()
        self._where: dict[str, tuple[str, str]] = {}     # node id -> (ray node, url)
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dsec-discovery")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for node in list(self.edges):
            await self._drop(node, "apiserver stopping")
        for t in list(self._closing):
            t.cancel()          # closes them now
        await asyncio.gather(*list(self._closing), return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:      # Ray briefly unreachable: keep the last view, try again
                log.exception("edge discovery failed")

    async def refresh(self) -> None:
        alive = await asyncio.to_thread(live_names)       # node name -> the Ray node offering it
        names = await asyncio.to_thread(named_actors, EDGE_PREFIX)
        seen: set[str] = set()
        for name in names:
            node = name.removeprefix(EDGE_PREFIX)
            seen.add(node)
            if node not in alive:    # no live raylet offers its name: never asked (it cannot answer)
                if node in self.edges:
                    await self._drop(node, "its Ray node is dead")
                continue
            known = self._where.get(node)
            if known is not None:
                if known[0] != alive[node]:     # its raylet started again: a new edge actor there
                    await self._drop(node, "its Ray node is dead")
                    continue
                status = self.watcher.node(node)
                if status is None or status.healthy:
                    continue
                # unhealthy on a live node: Ray may have restarted the edge actor (a crash),
                # which serves on a new port once asked for its address (it starts then)
                addr = await actor_address(name, RESTART_TIMEOUT_S)
                if addr is not None and addr["url"] != known[1]:
                    await self._drop(node, "its edge restarted")
                    self._add(node, addr["ray_node"], addr["url"])
                continue
            addr = await actor_address(name)
            if addr is None or addr["ray_node"] != alive[node] or addr["node_id"] != node:
                continue
            self._add(node, addr["ray_node"], addr["url"])
        for node in set(self.edges) - seen:
            await self._drop(node, "its edge actor is gone")

    def _add(self, node: str, ray_node: str, url: str) -> None:
        if self._tls is not None and not url.startswith("https://"):
            if (node, url) in self._refused:
                return
            self._refused.add((node, url))
            log.error("edge refused: it serves plain HTTP while this apiserver verifies edges with the cluster CA "
                      "(run `dsec cluster down` and `up` again to restart it with TLS)",
                      extra={"node": node, "url": url, "field": "edge_tls"})
            return
        try:
            edge = HttpEdge(url, self._secret, node, tls=self._tls, ca_file=self._ca_file)
            fn = HttpFnCall(url, self._secret, node, tls=self._tls, ca_file=self._ca_file)
        except DsecError as e:     # an https edge and no CA here: say so, keep discovering the others
            if (node, url) in self._refused:
                return
            self._refused.add((node, url))
            log.error("edge refused", extra={"node": node, "url": url, "error": e.message, "fix": e.fix})
            return
        self.edges.set(node, edge)
        self.fncall.set(node, fn)
        self._where[node] = (ray_node, url)
        self.watcher.add_edge(node, edge)
        log.info("edge joined", extra={"node": node, "url": url})

    async def _drop(self, node: str, why: str) -> None:
        edge = self.edges.pop(node)
        fn = self.fncall.pop(node)
        self._where.pop(node, None)
        self.watcher.remove_edge(node)
        # requests already holding these clients finish (or fail as unreachable) before they close
        clients = [c for c in (edge, fn) if c is not None]
        if clients:
            task = asyncio.create_task(self._close_later(clients))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        log.warning("edge left", extra={"node": node, "reason": why})

    async def _close_later(self, clients: list[Any], delay_s: float = 30.0) -> None:
        try:
            await asyncio.sleep(delay_s)
        finally:
            for c in clients:
                await c.aclose()
