"""`exec true` latency by cpu_cores on a running dsec (D35): 5 sandboxes per setting, 60
sequential `sb.run("true")`, p50/p90/p99. Compare DSEC_CPU_QUOTA_FLOOR_CORES=0 (the kernel's
1 ms minimum: the old behaviour) with the default floor by restarting `dsec up` between runs.

    .venv/bin/python benchmarks/cpu_quota_floor.py 0.005 0.05 0.1
"""
import asyncio
import sys
import time

from dsec import Client, ContainerArgs


async def main(cores: float) -> None:
    async with Client() as c:
        sbs = [await c.create_container(ContainerArgs(image="debian-python", cpu_cores=cores, memory_mb=48))
               for _ in range(5)]
        await asyncio.sleep(2)
        lat = []
        for i in range(60):
            t = time.perf_counter()
            await sbs[i % 5].run("true")
            lat.append((time.perf_counter() - t) * 1000)
            await asyncio.sleep(0.05)
        lat.sort()
        print(f"cpu_cores={cores}: p50 {lat[30]:.1f} ms, p90 {lat[54]:.1f} ms, p99 {lat[-1]:.1f} ms")
        for sb in sbs:
            await sb.stop()


for arg in sys.argv[1:]:
    asyncio.run(main(float(arg)))
