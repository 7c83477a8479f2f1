"""The same rollout through the stock `e2b` SDK against dsec and through dsec's own SDK, side by
side in one run: how much the E2B drop-in costs over the native path.

    python benchmarks/e2b_rollouts.py --n 100 --concurrency 8 --isolated   # its own `dsec up` in a temp home
    python benchmarks/e2b_rollouts.py --n 100                  # the local dsec (DSEC_URL/DSEC_API_KEY else)

A rollout: create a sandbox (template/image debian-python), run 10 commands one after another,
write a file and read it back, kill the sandbox. The two kinds alternate in rounds of
`concurrency` rollouts so that noise on the node hits both. Prints p50/p95 per rollout and per
phase and the e2b/dsec ratio of the medians (goal in docs/e2b.md: <= 1.3).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from e2b import AsyncSandbox

from dsec import Client, ContainerArgs
from dsec.bench.server import BenchServer
from dsec.config import DEFAULT_PORT, Paths

COMMANDS = 10
IMAGE = "debian-python"


async def dsec_rollout(c: Client) -> dict[str, float]:
    t0 = time.perf_counter()
    sb = await c.create_container(ContainerArgs(image=IMAGE, cpu_cores=0.5, memory_mb=256))
    t1 = time.perf_counter()
    try:
        for i in range(COMMANDS):
            r = await sb.run(f"echo {i}")
            assert r.stdout == f"{i}\n", r
        t2 = time.perf_counter()
        await sb.files.write("/tmp/f.txt", b"payload" * 100)
        assert await sb.files.read("/tmp/f.txt") == b"payload" * 100
        t3 = time.perf_counter()
    finally:
        await sb.stop()
    t4 = time.perf_counter()
    return {"create": t1 - t0, "commands": t2 - t1, "files": t3 - t2, "kill": t4 - t3, "total": t4 - t0}


async def e2b_rollout() -> dict[str, float]:
    t0 = time.perf_counter()
    sb = await AsyncSandbox.create(IMAGE, timeout=600)
    t1 = time.perf_counter()
    try:
        for i in range(COMMANDS):
            r = await sb.commands.run(f"echo {i}")
            assert r.stdout == f"{i}\n", r
        t2 = time.perf_counter()
        await sb.files.write("/tmp/f.txt", b"payload" * 100)
        assert await sb.files.read("/tmp/f.txt", format="bytes") == b"payload" * 100
        t3 = time.perf_counter()
    finally:
        await sb.kill()
    t4 = time.perf_counter()
    return {"create": t1 - t0, "commands": t2 - t1, "files": t3 - t2, "kill": t4 - t3, "total": t4 - t0}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(name: str, rows: list[dict[str, float]], wall: float) -> dict[str, float]:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    cells = "  ".join(f"{k} {med[k] * 1000:7.1f} / {pct([r[k] for r in rows], 0.95) * 1000:7.1f}" for k in med)
    print(f"  {name:<5} {cells}   (ms, p50 / p95, n={len(rows)}; {len(rows) / wall:.2f} rollouts/s)")
    return med


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100, help="rollouts of each kind")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--url", default=os.environ.get("DSEC_URL", f"http://127.0.0.1:{DEFAULT_PORT}"))
    ap.add_argument("--key", default=os.environ.get("DSEC_API_KEY"))
    ap.add_argument("--isolated", action="store_true", help="start a `dsec up` of its own (temp home, own port)")
    a = ap.parse_args()
    if a.isolated:
        srv = BenchServer("dsec-bench-e2b-")
        try:
            srv.prepare(["debian-python"])
            srv.start()
            await run(a, srv.url, srv.key)
        finally:
            srv.close()
    else:
        await run(a, a.url, a.key or Paths.from_env().admin_key_file.read_text().strip())


async def run(a: argparse.Namespace, url: str, key: str) -> None:
    # the two variables (docs/e2b.md) that point the stock SDK at dsec, and the key
    os.environ.update({"E2B_API_URL": f"{url}/e2b", "E2B_SANDBOX_URL": f"{url}/e2b", "E2B_API_KEY": key})
    rows: dict[str, list[dict[str, float]]] = {"dsec": [], "e2b": []}
    wall = {"dsec": 0.0, "e2b": 0.0}
    async with Client(url, key, autostart=False) as c:
        await dsec_rollout(c)          # warm both paths once (image mounts, connections)
        await e2b_rollout()
        done = 0
        while done < a.n:
            k = min(a.concurrency, a.n - done)
            for name, one in (("dsec", lambda: dsec_rollout(c)), ("e2b", e2b_rollout)):
                t0 = time.perf_counter()
                rows[name] += await asyncio.gather(*(one() for _ in range(k)))
                wall[name] += time.perf_counter() - t0
            done += k
            print(f"  {done}/{a.n} rollouts of each kind", flush=True)
    print(f"{a.n} rollouts of each kind, {a.concurrency} at a time, image {IMAGE}:")
    med = {name: report(name, rows[name], wall[name]) for name in rows}
    ratios = "  ".join(f"{k} {med['e2b'][k] / med['dsec'][k]:.2f}" for k in med["dsec"])
    print(f"  e2b/dsec median ratio: {ratios}; wall {wall['e2b'] / wall['dsec']:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
