"""`PYTHONPATH=src python benchmarks/create_cpu.py N INFLIGHT` (as root): CPU per create (ms): server process, its reaped children (nsexec, crun), the sandbox's own cgroup
(the agent's start), this client; raw `crun run -d` of the same rootfs at the same parallelism:
crun (reaped children) + the container's cgroup. Wall rate too (noisy on a shared box). Then the server's CPU per stop of the N (crun delete
among its children)."""
import asyncio, os, sys, time, resource
from pathlib import Path
from dsec.bench.server import BenchServer
from dsec.bench.density import Raw, RAW_CGROUP_PARENT
from dsec.backends.container.spec import cgroup_path
from dsec.images.service import ImageService
from dsec.types import ContainerArgs
from procstat import TCK, cpu_ticks
N = int(sys.argv[1]); CONC = int(sys.argv[2])
def proc_cpu(pid):
    return [t / TCK * 1000 for t in cpu_ticks(pid)]
def cg_ms(rel):
    try: return int(Path(f"/sys/fs/cgroup/cpuacct{rel}/cpuacct.usage").read_text()) / 1e6
    except OSError: return 0.0
def self_ms(who):
    r = resource.getrusage(who); return (r.ru_utime + r.ru_stime) * 1000
async def main():
    s = BenchServer("dsec-cpu-"); s.prepare(["debian-python"]); s.start()
    try:
        async with s.client() as c:
            args = ContainerArgs(image="debian-python", cpu_cores=0.005, memory_mb=48, ttl_idle_s=3600)
            sbs = []
            async for r in c.create_many(8, args, concurrency=CONC): sbs.append(r.sandbox)
            pid = s.proc.pid
            c0, me0, t0 = proc_cpu(pid), self_ms(resource.RUSAGE_SELF), time.perf_counter()
            new = []
            async for r in c.create_many(N, args, concurrency=CONC):
                assert r.sandbox, r.error; new.append(r.sandbox)
            dt = time.perf_counter() - t0; c1, me1 = proc_cpu(pid), self_ms(resource.RUSAGE_SELF)
            agent = sum(cg_ms(cgroup_path(sb.id)) for sb in new) / N
            d = [(b - a) / N for a, b in zip(c0, c1)]
            srv, kids, cli = d[0] + d[1], d[2] + d[3], (me1 - me0) / N
            raw = Raw(ImageService(s.paths).mount_image("debian-python")[0]); cids = [f"c{os.getpid()}-{i}" for i in range(N)]
            await asyncio.to_thread(lambda: [raw._bundle(x) for x in cids])
            k0, t0 = self_ms(resource.RUSAGE_CHILDREN), time.perf_counter()
            sem = asyncio.Semaphore(CONC)
            async def one(cid):
                async with sem: await asyncio.to_thread(raw.run, cid)
            await asyncio.gather(*(one(x) for x in cids))
            rdt = time.perf_counter() - t0; rk = (self_ms(resource.RUSAGE_CHILDREN) - k0) / N
            rcg = sum(cg_ms(f"{RAW_CGROUP_PARENT}/{x}") for x in cids) / N
            await asyncio.to_thread(raw.cleanup)
            tot = srv + kids + agent + cli
            print(f"conc {CONC} n {N}: dsec {N/dt:.1f}/s raw {N/rdt:.1f}/s ratio {rdt/dt:.2f} | CPU ms/create dsec: server {srv:.1f} "
                  f"(user {d[0]:.1f}) children {kids:.1f} sandbox-cgroup {agent:.1f} client {cli:.1f} = {tot:.1f}; raw: crun {rk:.1f} "
                  f"container {rcg:.1f} = {rk+rcg:.1f}; cpu ratio {(rk+rcg)/tot:.2f} | load1 {os.getloadavg()[0]:.1f}", flush=True)
            sem = asyncio.Semaphore(CONC)
            async def stop(sb):
                async with sem: await sb.stop()
            s0 = proc_cpu(pid)
            await asyncio.gather(*(stop(sb) for sb in new))
            s1 = proc_cpu(pid); sd = [(b - a) / N for a, b in zip(s0, s1)]
            print(f"  stop, {CONC} in flight: CPU ms/stop server {sd[0] + sd[1]:.1f} children {sd[2] + sd[3]:.1f}", flush=True)
            await asyncio.gather(*(stop(sb) for sb in sbs))
    finally:
        s.close()
asyncio.run(main())
