"""Paired comparison of SDK client variants under the same load (the client's CPU, issue 29 item 3).

One isolated `dsec up` (this checkout's); per variant one long-lived worker process running the
blocking SDK from its own PYTHONPATH (and environment); blocks of the same work alternate between
the workers, each measuring its own CPU (getrusage, every thread) around its block only:

    PYTHONPATH=src:benchmarks python benchmarks/client_cpu_ab.py --blocks 8 \\
        --variant before:/path/to/main/src --variant after:src --variant httpx:src:DSEC_SDK_HTTP=httpx
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from dsec.bench.server import BenchServer

WORKER = r'''
import json, resource, statistics, sys, time
from dsec.sdk.sync import SyncClient
from dsec.types import ContainerArgs
url, key, rounds, execs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
args = ContainerArgs(image="busybox", cpu_cores=1, memory_mb=256)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c = SyncClient(url, key)
sb = c.create_container(args)
for _ in range(3):
    s2 = c.create_container(args); s2.run("true"); s2.stop()
for _ in range(20):
    sb.run("true")
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "block":
        break
    t0 = cpu()
    for _ in range(rounds):
        s2 = c.create_container(args); s2.run("true"); s2.run("true"); s2.stop()
    t1 = cpu()
    lat = []
    for _ in range(execs):
        a = time.perf_counter(); sb.run("true"); lat.append(time.perf_counter() - a)
    t2 = cpu()
    print(json.dumps({"round_client_ms": round((t1 - t0) / rounds * 1000, 3),
                      "exec_client_ms": round((t2 - t1) / execs * 1000, 3),
                      "exec_p50_ms": round(statistics.median(lat) * 1000, 2)}), flush=True)
sb.stop()
c.close()
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", required=True, help="NAME:PYTHONPATH[:K=V,K=V]")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10, help="create + 2 runs + stop per block")
    ap.add_argument("--execs", type=int, default=200, help="`true` runs per block")
    a = ap.parse_args()
    srv = BenchServer("dsec-bench-client-")
    workers: list[tuple[str, subprocess.Popen[str]]] = []
    res: dict[str, dict[str, list[float]]] = {}
    try:
        srv.prepare(["busybox"])
        srv.start()
        for spec in a.variant:
            name, pypath, *rest = spec.split(":")
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in pypath.split(","))
            for kv in (rest[0].split(",") if rest and rest[0] else []):
                k, v = kv.split("=", 1)
                env[k] = v
            p = subprocess.Popen([sys.executable, "-c", WORKER, srv.url, srv.key, str(a.rounds), str(a.execs)],
                                 env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", name
            workers.append((name, p))
        for _ in range(a.blocks):
            for name, p in workers:
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write("block\n")
                p.stdin.flush()
                for k, v in json.loads(p.stdout.readline()).items():
                    res.setdefault(name, {}).setdefault(k, []).append(v)
    finally:
        for _, p in workers:
            try:
                assert p.stdin is not None
                p.stdin.close()
                p.wait(timeout=60)
            except Exception:
                p.kill()
        srv.close()
    print(json.dumps({n: {k: statistics.median(x) for k, x in r.items()} for n, r in res.items()}))
    print(json.dumps(res))
    print(json.dumps({"load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
