"""`PYTHONPATH=src python benchmarks/create_seq.py N [GAP_S]` (as root): the wall time of one start at a
time, dsec's create (SDK call -> sandbox ready) and raw `crun run -d` of the same EROFS rootfs, GAP_S
apart (default 0.1 s: each start meets the kernel idle, as a lone create does), p50/p90 in ms."""
import asyncio, os, statistics, sys, time
from dsec.bench.server import BenchServer
from dsec.bench.density import Raw
from dsec.images.service import ImageService
from dsec.types import ContainerArgs
N = int(sys.argv[1]); GAP = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
def q(xs): xs = sorted(xs); return f"p50 {statistics.median(xs):.1f} p90 {xs[int(.9 * (len(xs) - 1))]:.1f}"
async def main():
    s = BenchServer("dsec-seq-"); s.prepare(["debian-python"]); s.start()
    try:
        async with s.client() as c:
            args = ContainerArgs(image="debian-python", cpu_cores=0.005, memory_mb=48, ttl_idle_s=3600)
            raw = Raw(ImageService(s.paths).mount_image("debian-python")[0])
            sbs = [await c.create(args) for _ in range(3)]
            cids = [f"s{os.getpid()}-{i}" for i in range(N + 3)]
            for x in cids: raw._bundle(x)
            for x in cids[:3]: raw.run(x)
            d, r = [], []
            for i in range(N):      # alternating, so the box's state weighs on both alike
                await asyncio.sleep(GAP); t = time.perf_counter(); sbs.append(await c.create(args)); d.append((time.perf_counter() - t) * 1000)
                await asyncio.sleep(GAP); t = time.perf_counter(); raw.run(cids[3 + i]); r.append((time.perf_counter() - t) * 1000)
            print(f"sequential starts, {N} each, {GAP}s apart: dsec create {q(d)} ms; raw crun run -d {q(r)} ms; "
                  f"ratio p50 {statistics.median(d) / statistics.median(r):.2f} | load1 {os.getloadavg()[0]:.2f}", flush=True)
            raw.cleanup()
            for sb in sbs: await sb.stop()
    finally:
        s.close()
asyncio.run(main())
