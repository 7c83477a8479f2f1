"""Paired comparison of server variants under the same load (the CPU of every request, issue 29).

Starts one isolated `dsec up` per variant (its own PYTHONPATH and environment: another checkout's
src, a library on a side path, a setting), then alternates blocks of the same work between them,
so that whatever else runs on the machine weighs on every variant alike; reports per variant the
median over blocks of the server's CPU per operation (and per round its reaped children's).

    PYTHONPATH=src python benchmarks/request_cpu_ab.py --blocks 8 \\
        --variant before:/path/to/old/src --variant after:src --variant uv:src:DSEC_X=1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import httpx

from request_cpu import Meter, per  # noqa: E402  (beside this file)

from dsec.bench.server import BenchServer
from dsec.sdk.sync import SyncClient
from dsec.types import ContainerArgs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", required=True, help="NAME:PYTHONPATH[:K=V,K=V]")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10, help="create + 2 runs + stop per block")
    ap.add_argument("--execs", type=int, default=100, help="`true` runs per block")
    ap.add_argument("--run-code", type=int, default=0, help="/run_code print(1) per block")
    a = ap.parse_args()
    args = ContainerArgs(image="busybox", cpu_cores=1, memory_mb=256)
    variants: list[dict] = []
    servers: list[BenchServer] = []
    try:
        for spec in a.variant:
            name, pypath, *rest = spec.split(":")
            srv = BenchServer(f"dsec-bench-ab-{name}-")
            servers.append(srv)      # closed below even when it never became healthy
            srv.env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in pypath.split(","))
            for kv in (rest[0].split(",") if rest and rest[0] else []):
                k, v = kv.split("=", 1)
                srv.env[k] = v
            srv.prepare(["busybox"] + (["fncall-python"] if a.run_code else []))
            srv.start()
            c = SyncClient(srv.url, srv.key)
            h = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.key}"}, timeout=60)
            sb = c.create_container(args)
            for _ in range(3):
                s2 = c.create_container(args)
                s2.run("true")
                s2.stop()
            for _ in range(20):
                sb.run("true")
            for _ in range(10 if a.run_code else 0):
                h.post("/run_code", json={"code": "print(1)", "language": "python"})
            variants.append({"name": name, "srv": srv, "c": c, "sb": sb, "h": h, "res": {}})
        for _ in range(a.blocks):
            for v in variants:
                pid, res = v["srv"].proc.pid, v["res"]
                with Meter(pid) as m:
                    for _ in range(a.rounds):
                        s2 = v["c"].create_container(args)
                        s2.run("true")
                        s2.run("true")
                        s2.stop()
                res.setdefault("round_server_ms", []).append(per(m.server, a.rounds))
                res.setdefault("round_children_ms", []).append(per(m.children, a.rounds))
                res.setdefault("round_client_ms", []).append(per(m.client, a.rounds))
                lat = []
                with Meter(pid) as m:
                    for _ in range(a.execs):
                        t0 = time.perf_counter()
                        v["sb"].run("true")
                        lat.append((time.perf_counter() - t0) * 1000)
                res.setdefault("exec_server_ms", []).append(per(m.server, a.execs))
                res.setdefault("exec_client_ms", []).append(per(m.client, a.execs))
                res.setdefault("exec_p50_ms", []).append(round(statistics.median(lat), 2))
                if a.run_code:
                    lat = []
                    with Meter(pid) as m:
                        for _ in range(a.run_code):
                            t0 = time.perf_counter()
                            v["h"].post("/run_code", json={"code": "print(1)", "language": "python"})
                            lat.append((time.perf_counter() - t0) * 1000)
                    res.setdefault("run_code_server_ms", []).append(per(m.server, a.run_code))
                    res.setdefault("run_code_p50_ms", []).append(round(statistics.median(lat), 2))
    finally:
        for v in variants:
            try:
                v["sb"].stop()
                v["c"].close()
                v["h"].close()
            except Exception:
                pass
        for srv in servers:
            srv.close()
    print(json.dumps({v["name"]: {k: statistics.median(x) for k, x in v["res"].items()} for v in variants}))
    print(json.dumps({v["name"]: v["res"] for v in variants}))
    print(json.dumps({"load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
