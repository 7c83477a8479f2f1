"""`PYTHONPATH=src python benchmarks/burst_floor.py ROUNDS [BURST] [VARIANT,...]` (as root): the floor of a
cold burst (issue 29 item 2, D103). Per round, in rotating order: a burst of BURST raw `crun run echo
hi` on the image's EROFS rootfs (dsec's density baseline), one of BURST dsec creates -> `echo hi` ->
first stdout (an isolated server, automatic warm pools off: every create cold), and one burst of
`crun run echo hi` with dsec's containment (dsec/bench/floor.py: the driver's config.json and nsexec
argv replayed, no server, no agent) per VARIANT: `full`, or `no-PART` with one part switched off in
the replay (userns, overlay, seccomp, masks, lxcfs, netns, limits, crun_ro), or `bare` (all off);
`raw+hold`, `full+hold` ...: the container lives on 3 s after its output (`sh -c 'echo hi; exec sleep
3'`), so its teardown falls after the burst's outputs, as a dsec sandbox's does.
Default variants: all. Prints per variant the median over rounds of p50 / p99 / wall / children's
CPU per create, each p50 also as a ratio to the same round's raw p50; writes the raw numbers to
/tmp/burst-floor.json. Before each burst the CPUs must be quiet (floor.quiet). The server is started first, then /tmp/dsec-bench.lock is taken
exclusively for the bursts."""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
import statistics
import sys
import time
from pathlib import Path

from dsec.bench.density import NoOutput, Raw, create_echo, crun_burst
from dsec.bench.floor import PARTS, VARIANTS, Kit, floor_burst, hold_args, quiet
from dsec.bench.server import BenchServer
from dsec.images.service import ImageService
from dsec.types import ContainerArgs, DsecError

IMAGE = os.environ.get("IMAGE", "debian-python")
HOLD_S = 3.0    # a `+hold` variant's containers live this long after their output (floor.hold_args)


async def dsec_burst(c, n: int) -> dict:
    args = ContainerArgs(image=IMAGE, cpu_cores=1, memory_mb=256, ttl_idle_s=600, labels={"bench": "floor"})
    sbs, ttfo, errs = [], [], []

    async def one() -> None:
        try:
            ms, _ = await create_echo(c, args, sbs.append)
            ttfo.append(ms)
        except (NoOutput, DsecError) as e:   # reported, not raised: the round goes on
            errs.append(f"{type(e).__name__}: {e}")
    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - t0
    await asyncio.gather(*(sb.stop() for sb in sbs), return_exceptions=True)
    ttfo.sort()
    return {"n": len(ttfo), "p50_ms": statistics.median(ttfo) if ttfo else None,
            "p99_ms": ttfo[min(len(ttfo) - 1, int(0.99 * len(ttfo)))] if ttfo else None,
            "wall_s": wall, "failed": len(errs), "errors": errs[:3]}


async def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    variants = sys.argv[3].split(",") if len(sys.argv) > 3 else list(VARIANTS)
    for v in variants:
        if v.removesuffix("+hold") not in [*VARIANTS, "raw"]:
            raise SystemExit(f"unknown variant {v!r}: {', '.join(VARIANTS)}, raw, each with an optional +hold")
    server = BenchServer("dsec-bench-floor-")
    os.environ["DSEC_WARM_POOL_AUTO"] = "0"
    out: dict = {"rounds": [], "n": n, "image": IMAGE, "parts": PARTS}
    try:
        server.prepare([IMAGE])
        server.start()
        layers = ImageService(server.paths).mount_image(IMAGE)
        kit = Kit(server.paths, layers[0])
        order = ["raw", "dsec", *variants]
        async with server.client() as c:
            await c.set_warm_pools(None, auto=0)
            await dsec_burst(c, 4)                      # warm-up: the image's first use
            lock = os.open("/tmp/dsec-bench.lock", os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                for r in range(rounds):
                    k = r % len(order)
                    row: dict = {"load1": os.getloadavg()[0]}
                    for name in order[k:] + order[:k]:
                        await quiet()
                        hold = HOLD_S if name.endswith("+hold") else 0
                        base = name.removesuffix("+hold")
                        if base == "raw":
                            raw = Raw(layers[0], hold_args(hold) if hold else ["echo", "hi"])
                            row[name] = await crun_burst(raw, [f"fr{os.getpid()}-{r}-{i}" for i in range(n)])
                        elif name == "dsec":
                            row[name] = await dsec_burst(c, n)
                        else:
                            row[name] = await floor_burst(kit, n, base, tag=f"f{r}", hold_s=hold)
                        row[name].pop("ttfo_ms", None)
                    out["rounds"].append(row)
                    print(f"round {r + 1}: " + ", ".join(f"{k2} {v['p50_ms']:.0f}" for k2, v in row.items()
                                                         if isinstance(v, dict) and v.get("p50_ms")), flush=True)
            finally:
                os.close(lock)
    finally:
        server.close()
    def med(xs: list) -> float:
        return statistics.median(xs) if xs else float("nan")
    print(f"\n{'variant':<12} {'p50 ms':>8} {'x raw':>6} {'p99 ms':>8} {'last s':>7} {'cpu ms':>7} {'prep ms':>8} failed")
    for name in ["raw", "dsec", *variants]:
        rs = [row[name] for row in out["rounds"]]
        ratio = [row[name]["p50_ms"] / row["raw"]["p50_ms"] for row in out["rounds"] if row[name]["p50_ms"]]
        print(f"{name:<12} {med([x['p50_ms'] for x in rs if x['p50_ms']]):>8.0f} {med(ratio):>6.2f} "
              f"{med([x['p99_ms'] for x in rs if x['p99_ms']]):>8.0f} {med([x.get('last_output_s') or x['wall_s'] for x in rs]):>7.2f} "
              f"{med([x.get('cpu_ms_per_create', float('nan')) for x in rs]):>7.1f} "
              f"{med([x.get('prep_ms', float('nan')) for x in rs]):>8.1f} {sum(x['failed'] for x in rs)}")
        errs = [e for x in rs for e in x.get("errors", [])]
        if errs:
            print(f"  first error: {errs[0]}")
    await asyncio.to_thread(Path("/tmp/burst-floor.json").write_text, json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    asyncio.run(main())
