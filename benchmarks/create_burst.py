"""`PYTHONPATH=src python benchmarks/create_burst.py ROUNDS [BURST]` (as root): the density bench's burst
shape alone, on one isolated server: BURST concurrent create -> `echo hi` -> first stdout, then BURST
raw `crun run echo hi` of the same rootfs at once, ROUNDS times alternating; p50 of each and the ratio
per round (the server's env, e.g. DSEC_CREATE_PARALLEL, is this process's)."""
import asyncio, os, statistics, sys, time
from dsec.bench.server import BenchServer
from dsec.bench.density import Raw, crun_burst
from dsec.images.service import ImageService
from dsec.types import ContainerArgs
ROUNDS = int(sys.argv[1]); BURST = int(sys.argv[2]) if len(sys.argv) > 2 else 50


async def dsec_burst(c, args) -> list[float]:
    ttfo: list[float] = []
    sbs = []

    async def one() -> None:
        t0 = time.perf_counter()
        sb = await c.create(args)
        sbs.append(sb)
        async for ev in sb.stream("echo hi", timeout_s=120):
            if ev.type == "stdout":
                ttfo.append((time.perf_counter() - t0) * 1000)
                break
    await asyncio.gather(*(one() for _ in range(BURST)))
    sem = asyncio.Semaphore(16)

    async def stop(sb) -> None:
        async with sem:
            await sb.stop()
    await asyncio.gather(*(stop(sb) for sb in sbs))
    return ttfo


async def main() -> None:
    s = BenchServer("dsec-burst-"); s.prepare(["debian-python"]); s.start()
    try:
        async with s.client() as c:
            args = ContainerArgs(image="debian-python", cpu_cores=1, memory_mb=256, ttl_idle_s=3600)
            await dsec_burst(c, args)        # warm-up: image mounts, first-time paths
            rootfs = ImageService(s.paths).mount_image("debian-python")[0]
            for r in range(ROUNDS):
                d = statistics.median(await dsec_burst(c, args))
                raw = await crun_burst(Raw(rootfs, ["echo", "hi"]), [f"b{os.getpid()}-{r}-{i}" for i in range(BURST)])
                print(f"round {r}: burst {BURST} p50 ms dsec {d:.0f} raw {raw['p50_ms']:.0f} ratio {d / raw['p50_ms']:.2f} "
                      f"| load1 {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        s.close()
asyncio.run(main())
