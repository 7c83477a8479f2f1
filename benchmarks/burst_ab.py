"""`PYTHONPATH=src python benchmarks/burst_ab.py ROUNDS VARIANT,... [BURST]` (as root): bursts of
BURST concurrent create -> `echo hi` -> first stdout on several isolated servers that differ only in
their environment, alternating server by server each round, with one raw burst of BURST
`crun run echo hi` (the same rootfs) per round. VARIANTs: `slots=N` (DSEC_CREATE_PARALLEL=N),
`pool` (DSEC_WARM_POOL=debian-python:BURST, waited full and settled before each of its bursts),
`src=PATH` (the server from another checkout's src: old code), any `K=V` of the server's
environment; parts joined by '+' (e.g. `pool+DSEC_CREATE_CONCURRENCY=4`).
Per variant and round: p50/p99 of create -> first output, the create call's p50, the first
command's part (first output - create returned) p50, and the edge's stages (mean of the
dsec_sandbox_create_seconds histogram over the burst: prepare, admission, slot, start, agent).
CPU per create + first command: the server process (utime+stime, its reaped children too) and
this client process. Medians over rounds at the end; the load average (1 min) beside each burst.
The servers are made and started first, then /tmp/dsec-bench.lock is taken exclusively for the
bursts. SPY=VARIANT: py-spy records that variant's server during its bursts (collapsed stacks in
/tmp/burst-spy-VARIANT-ROUND.txt; PY_SPY: its path, SPY_ARGS: more of its options, e.g. --gil;
not for timing figures)."""
from __future__ import annotations

import asyncio
import fcntl
import os
import resource
import subprocess
import re
import statistics
import sys
import time

import httpx

from dsec.bench.density import NoOutput, Raw, create_echo, crun_burst
from dsec.bench.server import BenchServer
from dsec.bench.warm_fill import wait_full
from dsec.images.service import ImageService
from dsec.types import ContainerArgs
from procstat import TCK, cpu_ticks

IMAGE = "debian-python"
SPY = os.environ.get("SPY", "").split(",")
PY_SPY = os.environ.get("PY_SPY", "/work/main/.venv-verl/bin/py-spy")
STAGE_RE = re.compile(r'^dsec_sandbox_create_seconds_(sum|count)\{backend="container",stage="(\w+)"\} (\S+)$', re.M)


def env_of(variant: str, burst_n: int) -> dict[str, str]:
    """A variant is parts joined by '+': slots=N, pool, src=PATH, main (nothing), or any K=V.
    The node's automatic warm pools (D99) are off unless a K=V turns them on: every round's
    bursts have one shape, and a cold variant must stay cold."""
    env: dict[str, str] = {"DSEC_WARM_POOL_AUTO": "0"}
    for v in variant.split("+"):
        if v.startswith("slots="):
            env["DSEC_CREATE_PARALLEL"] = v.split("=", 1)[1]
        elif v == "pool":
            env["DSEC_WARM_POOL"] = f"{IMAGE}:{burst_n}"
        elif v.startswith("src="):
            env["PYTHONPATH"] = v.split("=", 1)[1]
        elif "=" in v:
            k, val = v.split("=", 1)
            env[k] = val
        elif v != "main":
            raise SystemExit(f"unknown variant part {v!r}: slots=N, pool, src=PATH, main or K=V")
    return env


def stages(srv: BenchServer) -> dict[str, tuple[float, float]]:
    r = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {srv.key}"})
    out: dict[str, list[float]] = {}
    for kind, stage, val in STAGE_RE.findall(r.text):
        out.setdefault(stage, [0.0, 0.0])[0 if kind == "sum" else 1] = float(val)
    return {k: (v[0], v[1]) for k, v in out.items()}


async def pool_full(srv: BenchServer, want: int, timeout_s: float = 300) -> None:
    async with srv.client() as c:
        waited, _ = await wait_full(c, IMAGE, want, timeout_s)
    if waited is None:
        raise RuntimeError(f"pool not full after {timeout_s} s")


def cpu_s(pid: int) -> float:
    """utime+stime of the process and its reaped children, seconds."""
    return sum(cpu_ticks(pid)) / TCK


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def burst(srv: BenchServer, n: int) -> dict:
    args = ContainerArgs(image=IMAGE, cpu_cores=1, memory_mb=256, ttl_idle_s=3600)
    ttfo: list[float] = []
    create: list[float] = []
    first_cmd: list[float] = []
    sbs = []
    before = await asyncio.to_thread(stages, srv)
    load1 = os.getloadavg()[0]
    assert srv.proc is not None
    cpu0, own0 = cpu_s(srv.proc.pid), own_cpu_s()
    async with srv.client() as c:
        async def one() -> None:
            try:
                first_ms, call_ms = await create_echo(c, args, sbs.append)
            except NoOutput:          # left out of the figures, as before
                return
            ttfo.append(first_ms)
            create.append(call_ms)
            first_cmd.append(first_ms - call_ms)
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
        cpu1, own1 = cpu_s(srv.proc.pid), own_cpu_s()
        after = await asyncio.to_thread(stages, srv)
        sem = asyncio.Semaphore(16)

        async def stop(sb) -> None:
            async with sem:
                await sb.stop()
        await asyncio.gather(*(stop(sb) for sb in sbs))
    st = {k: (after[k][0] - before.get(k, (0, 0))[0]) / max(1.0, after[k][1] - before.get(k, (0, 0))[1]) * 1000
          for k in after}
    q = statistics.quantiles(ttfo, n=100)
    return {"p50": statistics.median(ttfo), "p99": q[98], "create": statistics.median(create),
            "first_cmd": statistics.median(first_cmd), "wall": wall, "load1": load1, "stages": st, "n": len(ttfo),
            "server_cpu": (cpu1 - cpu0) / n * 1000, "client_cpu": (own1 - own0) / n * 1000}


async def run(rounds: int, variants: list[str], burst_n: int) -> None:
    envs = {v: env_of(v, burst_n) for v in variants}    # a bad variant stops the run before any home is made
    servers: dict[str, BenchServer] = {}
    try:
        for v in variants:
            # kept before it is prepared or started: the finally removes its home whatever fails
            s = servers[v] = BenchServer("dsec-burst-ab-")
            s.env.update(envs[v])
            s.prepare([IMAGE])
            s.start()
        lock = open("/tmp/dsec-bench.lock", "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
        print(f"lock taken, load1 {os.getloadavg()[0]:.2f}", flush=True)
        for v, s in servers.items():           # warm-up: image mounts, first-time paths
            if "pool" in v.split("+"):
                await pool_full(s, burst_n)
            await burst(s, burst_n)
        rootfs = ImageService(next(iter(servers.values())).paths).mount_image(IMAGE)[0]
        res: dict[str, list[dict]] = {v: [] for v in variants}
        raws: list[dict] = []
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                if "pool" in v.split("+"):
                    await pool_full(servers[v], burst_n)
                    await asyncio.sleep(3)     # the fill's starts settle, as a pool that waited
                await asyncio.sleep(1)
                spy = None
                if v in SPY:
                    spy = subprocess.Popen([PY_SPY, "record", "-p", str(servers[v].proc.pid), "-r", "200", "-f", "raw",
                                            "-o", f"/tmp/burst-spy-{v}-{r}.txt", *os.environ.get("SPY_ARGS", "").split()], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)
                    await asyncio.sleep(1)
                b = await burst(servers[v], burst_n)
                if spy is not None:
                    spy.send_signal(2)
                    await asyncio.to_thread(spy.wait)
                res[v].append(b)
                stg = " ".join(f"{k} {b['stages'][k]:.0f}" for k in ("prepare", "admission", "slot", "start", "agent")
                               if k in b["stages"])
                print(f"round {r} {v:>10}: p50 {b['p50']:.0f} p99 {b['p99']:.0f} create {b['create']:.0f} "
                      f"first cmd {b['first_cmd']:.0f} wall {b['wall']:.2f}s | edge mean ms: {stg} "
                      f"total {b['stages'].get('total', 0):.0f} | cpu ms/create server {b['server_cpu']:.1f} "
                      f"client {b['client_cpu']:.1f} | load1 {b['load1']:.2f}", flush=True)
            await asyncio.sleep(1)
            load1 = os.getloadavg()[0]
            raw = await crun_burst(Raw(rootfs, ["echo", "hi"]), [f"ab{os.getpid()}-{r}-{i}" for i in range(burst_n)])
            raws.append(raw)
            print(f"round {r} {'raw':>10}: p50 {raw['p50_ms']:.0f} p99 {raw['p99_ms']:.0f} wall {raw['wall_s']:.2f}s "
                  f"failed {raw['failed']} | load1 {load1:.2f}", flush=True)
        rp50 = statistics.median(x["p50_ms"] for x in raws)
        print(f"\nmedians over {rounds} rounds (burst {burst_n}); raw crun run p50 {rp50:.0f} ms")
        for v in variants:
            p50 = statistics.median(x["p50"] for x in res[v])
            print(f"{v:>10}: p50 {p50:.0f} ({p50 / rp50:.2f}x raw) p99 {statistics.median(x['p99'] for x in res[v]):.0f} "
                  f"create {statistics.median(x['create'] for x in res[v]):.0f} "
                  f"first cmd {statistics.median(x['first_cmd'] for x in res[v]):.0f} "
                  f"wall {statistics.median(x['wall'] for x in res[v]):.2f}s "
                  f"cpu ms/create server {statistics.median(x['server_cpu'] for x in res[v]):.1f} "
                  f"client {statistics.median(x['client_cpu'] for x in res[v]):.1f}")
    finally:
        for s in servers.values():
            s.close()


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    asyncio.run(run(int(argv[0]), argv[1].split(","), int(argv[2]) if len(argv) > 2 else 50))


if __name__ == "__main__":
    main(sys.argv[1:])
