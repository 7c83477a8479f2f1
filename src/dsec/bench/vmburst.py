"""`dsec bench vm-density --burst N`: N microVM clones created at once (C in flight), each to its
first `run("true")`, all kept alive, then stopped together (issue 31: a burst of 800 in < 3 min).

Reports the rate per block of 100 (it falls as the alive clones' idle CPU grows), MemAvailable
lost per clone, and stops creating early (saying so) when MemAvailable would fall below a floor:
the clones' memory is what the node's other work needs, and the burst measures creation.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

from dsec.bench.hostmem import mem_available_mib
from dsec.bench.server import BenchServer
from dsec.bench.vmdensity import Opts, _one, _pct
from dsec.sdk.client import Sandbox

console = Console()


async def _burst(server: BenchServer, o: Opts, n: int, floor_mib: float) -> dict:
    async with server.client() as c:
        sb, _ = await _one(c, o)              # the template build: not timed
        await sb.stop()
        base = mem_available_mib()
        sem = asyncio.Semaphore(o.inflight)
        sbs: list[Sandbox] = []
        done: list[float] = []
        lat: list[float] = []
        stopped_early = asyncio.Event()
        loads: list[float] = []

        async def go() -> None:
            async with sem:
                if stopped_early.is_set():
                    return
                if mem_available_mib() < floor_mib:
                    stopped_early.set()
                    return
                sb, s = await _one(c, o)
                sbs.append(sb)
                lat.append(s)
                done.append(time.perf_counter())
                if len(done) % 50 == 0:
                    loads.append(os.getloadavg()[0])
                    console.print(f"{len(done)} alive, {len(done) / (done[-1] - t0):.2f}/s, "
                                  f"load {loads[-1]:.1f}, MemAvailable {mem_available_mib():.0f} MiB")
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(go() for _ in range(n)))
            wall = done[-1] - t0 if done else float("nan")
            after = mem_available_mib()
            blocks = [100 / (done[i + 99] - (done[i - 1] if i else t0)) for i in range(0, len(done) - 99, 100)]
            res = {"n": len(done), "asked": n, "wall_s": wall, "clones_per_s": len(done) / wall,
                   "per_100": blocks, "p50_ms": _pct(lat, 50) * 1000, "p95_ms": _pct(lat, 95) * 1000,
                   "memavail_per_clone_mib": (base - after) / max(1, len(done)), "stopped_early": stopped_early.is_set(),
                   "load_max": max(loads, default=os.getloadavg()[0])}
        finally:
            t1 = time.perf_counter()
            sem2 = asyncio.Semaphore(8)

            async def stop(sb: Sandbox) -> None:
                async with sem2:
                    await sb.stop()
            await asyncio.gather(*(stop(sb) for sb in sbs), return_exceptions=True)
        res["stop_all_s"] = time.perf_counter() - t1
        return res


def run_burst(o: Opts, n: int, floor_mib: float, out: Path | None) -> dict:
    load_before = os.getloadavg()[0]
    server = BenchServer("dsec-bench-vmb-")
    try:
        server.prepare([o.image])
        server.start()
        r = asyncio.run(_burst(server, o, n, floor_mib))
    finally:
        leaked = server.close()
    if leaked:
        raise RuntimeError(f"QEMU processes outlived the bench (killed now): {leaked}")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = ["", f"Clone burst ({when}): `dsec bench vm-density --burst {n} --inflight {o.inflight} --memory-mb "
          f"{o.memory_mb} --burst-floor-gib {floor_mib / 1024:g}`: {r['n']} of {n} clones of {o.memory_mb} MiB "
          f"created and kept alive" + (" (stopped early: MemAvailable reached the floor)" if r["stopped_early"] else "")
          + f", {o.inflight} in flight, each to its first `true`; load average (1 min) before / highest while "
          f"creating / after {load_before:.2f} / {r['load_max']:.2f} / {os.getloadavg()[0]:.2f}.", "",
          "| clones | wall s | clones/s | each block of 100, clones/s | create -> first `true` p50 / p95 ms | "
          "MemAvailable lost per clone MiB | stopping all, s |", "|---|---|---|---|---|---|---|",
          f"| {r['n']} | {r['wall_s']:.1f} | {r['clones_per_s']:.2f} | {', '.join(f'{x:.2f}' for x in r['per_100'])} | "
          f"{r['p50_ms']:.0f} / {r['p95_ms']:.0f} | {r['memavail_per_clone_mib']:.1f} | {r['stop_all_s']:.1f} |"]
    console.print("\n".join(md))
    if out is not None:
        with out.open("a") as f:
            f.write("\n".join(md) + "\n")
    return r
