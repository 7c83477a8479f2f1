"""Single-machine create latency with and without the sandbox index writes (D38): a `dsec up`
of two source trees, alternating, each on its own DSEC_HOME, each round N sequential
create -> stop (p50/p99 of the create) and a burst of B concurrent creates (creations/s).

    git archive HEAD src | tar -x -C /tmp/dsec-before          # the code before the change
    .venv/bin/python benchmarks/index_create_latency.py /tmp/dsec-before/src src --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsec.testing.isolated import ServerProcess, cleanup_home, link_node_downloads


async def measure(url: str, key: str, n: int, burst: int) -> tuple[float, float, float]:
    from dsec import Client
    async with Client(url, key) as c:
        lat: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            sb = await c.create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
            lat.append(time.perf_counter() - t0)
            await sb.stop()
        t0 = time.perf_counter()
        sbs = await asyncio.gather(*(c.create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
                                     for _ in range(burst)))
        rate = burst / (time.perf_counter() - t0)
        await asyncio.gather(*(sb.stop() for sb in sbs))
    lat.sort()
    return statistics.median(lat) * 1000, lat[int(len(lat) * 0.99) - 1] * 1000, rate


def run_side(src: Path, n: int, burst: int) -> tuple[float, float, float]:
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-idx-", dir="/var/tmp"))
    link_node_downloads(home)
    env = {"PYTHONPATH": str(src.resolve()), "DSEC_HOME": str(home), "DSEC_VM": "0",
           **{f"DSEC_ADMIT_PSI_{k}": "100" for k in ("CPU_SOME", "MEMORY_SOME", "MEMORY_FULL", "IO_FULL")}}
    subprocess.run([sys.executable, "-m", "dsec", "image", "build", "busybox", "--builtin"],
                   env={**os.environ, **env}, check=True, capture_output=True)
    srv = ServerProcess(home, env)
    srv.start()
    try:
        return asyncio.run(measure(srv.url, srv.key, n, burst))
    finally:
        srv.kill(15)
        cleanup_home(home)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=60)
    ap.add_argument("--burst", type=int, default=20)
    a = ap.parse_args()
    res: dict[str, list[tuple[float, float, float]]] = {"before": [], "after": []}
    for i in range(a.rounds):
        for side, src in (("before", a.before), ("after", a.after)):
            r = run_side(src, a.n, a.burst)
            res[side].append(r)
            print(f"round {i + 1} {side}: create p50 {r[0]:.1f} ms p99 {r[1]:.1f} ms, burst {r[2]:.1f}/s "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    med = {s: [statistics.median(x[j] for x in v) for j in range(3)] for s, v in res.items()}
    b, f = med["before"], med["after"]
    print(f"median of rounds: p50 {b[0]:.1f} -> {f[0]:.1f} ms ({f[0] / b[0]:.2f}x), p99 {b[1]:.1f} -> {f[1]:.1f} ms "
          f"({f[1] / b[1]:.2f}x), burst {b[2]:.1f} -> {f[2]:.1f}/s ({f[2] / b[2]:.2f}x)")


if __name__ == "__main__":
    main()
