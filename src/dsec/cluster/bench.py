"""`dsec bench cluster`: creations/s through 2 apiserver replicas and 3 edges (a local
multi-node Ray cluster, cluster mode over HTTP) vs one embedded server, in the same run.

Both arms create the same sandboxes (busybox, 0.1 core, 64 MiB) at the same client
concurrency, each timed from the first create to the last answer, then stopped (not timed).
On one host the cluster's three edges share its cores: the ratio shows what the HTTP hop,
the replicas and placement over three nodes cost or gain, not what three hosts would do.
The replicas' own CPU time per create (their processes' user + system time over a burst) is
what sizes them: a replica is one event loop, so it serves at most 1 / (CPU s per create)
creates per second; `replicas_for_5000_per_s` counts them at 70 % of a core each.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec import procstat
from dsec.sdk.client import Client

# the shared box's PSI must not decide a benchmark (same for both arms)
NO_PSI = {f"DSEC_ADMIT_PSI_{k}": "100" for k in ("CPU_SOME", "MEMORY_SOME", "MEMORY_FULL", "IO_FULL")}


REPLICA_CORE_USE = 0.7      # of a core, what a replica is planned to use (headroom for bursts)
TARGET_PER_S = 5000


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used (their threads included)."""
    return sum(procstat.cpu_s(pid) for pid in pids)


async def _burst(clients: list[Client], n: int, concurrency: int, replica_pids: list[int] | None = None
                 ) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    made: list[Any] = []
    errors: list[str] = []

    async def one(i: int) -> None:
        async with sem:
            try:
                made.append(await clients[i % len(clients)].create_container(image="busybox", cpu_cores=0.1,
                                                                             memory_mb=64))
            except Exception as e:      # counted, not fatal: the rate is of successes
                errors.append(f"{type(e).__name__}: {e}")

    cpu0 = cpu_s(replica_pids) if replica_pids else 0.0
    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.monotonic() - t0
    cpu = cpu_s(replica_pids) - cpu0 if replica_pids else None
    nodes = sorted({sb.id.removeprefix("sb-").split(".")[0] for sb in made})
    await asyncio.gather(*(sb.stop() for sb in made), return_exceptions=True)
    out = {"created": len(made), "errors": len(errors), "first_error": errors[0] if errors else None,
           "wall_s": round(wall, 2), "per_s": round(len(made) / wall, 2) if wall else 0.0, "nodes": nodes}
    if cpu is not None and made:
        per = cpu / len(made)
        out |= {"replica_cpu_ms_per_create": round(per * 1000, 2),
                "replicas_for_5000_per_s": math.ceil(TARGET_PER_S * per / REPLICA_CORE_USE)}
    return out


async def _embedded(n: int, concurrency: int, rounds: int) -> list[dict[str, Any]]:
    from dsec.config import Paths
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService
    from dsec.testing.isolated import ServerProcess, cleanup_home, link_node_downloads

    home = Path(tempfile.mkdtemp(prefix="dsec-bench-emb-", dir="/var/tmp"))
    srv = None
    try:
        link_node_downloads(home)
        Paths(home).ensure()
        await asyncio.to_thread(ensure_builtin, ImageService(Paths(home)), "busybox")
        from dsec.cluster.actors import seed_native_helpers
        from dsec.settings import Settings
        seed_native_helpers(Settings.from_env().paths.bin, Paths(home).bin)     # as the cluster's edges get them
        srv = ServerProcess(home, {**NO_PSI, "DSEC_VM": "0"})
        await asyncio.to_thread(srv.start, 180)
        out = []
        async with Client(srv.url, srv.key) as c:
            await _burst([c], min(n, 8), concurrency)          # warm-up (image mounts, caches)
            for _ in range(rounds):
                out.append(await _burst([c], n, concurrency))
        return out
    finally:
        if srv is not None:
            srv.kill(signal.SIGTERM)
        cleanup_home(home)


async def _cluster(n: int, concurrency: int, rounds: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    from dsec.cluster.local import local_cluster
    from dsec.cluster.discovery import API_PREFIX, actor_address, named_actors
    async with local_cluster(nodes=3, replicas=2, edge_env=NO_PSI) as local:
        clients = [Client(url, local.admin_key) for url in local.replica_urls]
        # the replicas run on this host (local_cluster): their CPU time is read from /proc
        pids = [a["pid"] for a in [await actor_address(n) for n in await asyncio.to_thread(named_actors, API_PREFIX)]
                if a is not None and "pid" in a]
        try:
            await _burst(clients, min(n, 8), concurrency)
            out = [await _burst(clients, n, concurrency, pids) for _ in range(rounds)]
        finally:
            for c in clients:
                await c.close()
        return out, local.started_s


async def run(n: int = 60, concurrency: int = 8, rounds: int = 2) -> dict[str, Any]:
    embedded = await _embedded(n, concurrency, rounds)
    cluster, started = await _cluster(n, concurrency, rounds)
    best_e = max(r["per_s"] for r in embedded)
    best_c = max(r["per_s"] for r in cluster)
    return {"host": {"cpus": os.cpu_count(), "kernel": platform.release()},
            "n": n, "concurrency": concurrency, "rounds": rounds,
            "embedded": embedded, "cluster": cluster, "cluster_start_s": started,
            "best_per_s": {"embedded": best_e, "cluster": best_c},
            "cluster_over_embedded": round(best_c / best_e, 2) if best_e else None}


def main(n: int, concurrency: int, rounds: int) -> None:
    print(json.dumps(asyncio.run(run(n, concurrency, rounds)), indent=2))
