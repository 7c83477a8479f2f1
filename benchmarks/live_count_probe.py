"""`PYTHONPATH=src python benchmarks/live_count_probe.py N OUTDIR` (as root, under
`flock -x /tmp/dsec-bench.lock`): what grows with the number of live sandboxes (issue 29 item 1).

An isolated server; at 0 live and again at N live (debian-python, 0.005 cores / 48 MiB, the
density bench's shape): 250 creates at 8 in flight with py-spy on the server and `perf record -a
-g` over a second window of 100 (their rate is not the figure: the profilers slow it), the server's and the host's mount counts, the server's and its children's CPU
per create, 100 raw `crun run -d` beside; then 20 s idle with per-process CPU and 20 `exec true`.
Everything is stopped at the end."""
import asyncio, os, subprocess, sys, time, json
from pathlib import Path
from dsec.bench.server import BenchServer
from dsec.bench.density import Raw
from dsec.images.service import ImageService
from dsec.types import ContainerArgs
from procstat import TCK, cpu_ticks, processes

N = int(sys.argv[1]); OUT = Path(sys.argv[2]); OUT.mkdir(parents=True, exist_ok=True)
PYSPY = os.environ.get("PYSPY", "/work/main/.venv-verl/bin/py-spy")
PERF = os.environ.get("PERF", "1") == "1"
ARGS = ContainerArgs(image="debian-python", cpu_cores=0.005, memory_mb=48, ttl_idle_s=3600)


def proc_cpu(pid: int) -> list[float]:
    return [t / TCK * 1000 for t in cpu_ticks(pid)]


def all_cpu() -> dict[str, float]:
    return {f"{p}:{comm}": ticks / TCK * 1000 for p, comm, _, ticks in processes()}


def mounts(pid: int | str) -> int:
    try:
        return len(Path(f"/proc/{pid}/mountinfo").read_text().splitlines())
    except OSError:
        return -1


async def window(s, c, label: str, sbs: list, res: dict) -> None:
    r: dict = {"live": len(sbs), "load1": os.getloadavg()[0], "server_mounts": mounts(s.proc.pid),
               "host_mounts": mounts(1), "self_mounts": mounts("self"),
                  "proc_cgroups": {l.split()[0]: int(l.split()[2]) for l in Path("/proc/cgroups").read_text().splitlines()[1:]}}
    c0, t0 = proc_cpu(s.proc.pid), time.perf_counter()
    n = 250
    async for x in c.create_many(n, ARGS, concurrency=8):
        assert x.sandbox, x.error
        sbs.append(x.sandbox)
    dt = time.perf_counter() - t0
    c1 = proc_cpu(s.proc.pid)
    d = [(b - a) / n for a, b in zip(c0, c1)]
    r.update({"per_s": n / dt, "server_cpu_ms": d[0] + d[1], "children_cpu_ms": d[2] + d[3],
              "load1_after": os.getloadavg()[0], "server_fds": len(os.listdir(f"/proc/{s.proc.pid}/fd")),
              "server_threads": len(os.listdir(f"/proc/{s.proc.pid}/task"))})
    # a second window of 100 under the profilers (they slow it: its rate is not the figure)
    spy = subprocess.Popen([PYSPY, "record", "-p", str(s.proc.pid), "-r", "100", "-f", "raw", "-s", "-n",
                            "-o", str(OUT / f"pyspy-{label}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    perf = subprocess.Popen(["perf", "record", "-a", "-g", "-F", "199", "-o", str(OUT / f"perf-{label}.data")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if PERF else None
    await asyncio.sleep(1.5)
    t0 = time.perf_counter()
    async for x in c.create_many(100, ARGS, concurrency=8):
        assert x.sandbox, x.error
        sbs.append(x.sandbox)
    r["profiled_per_s"] = 100 / (time.perf_counter() - t0)
    for p in (spy, perf):
        if p is not None:
            p.send_signal(2)
    for p in (spy, perf):
        if p is not None:
            p.wait(120)
    # raw crun beside, same parallelism
    raw = Raw(ImageService(s.paths).mount_image("debian-python")[0])
    cids = [f"p{os.getpid()}-{label}-{i}" for i in range(100)]
    await asyncio.to_thread(lambda: [raw._bundle(x) for x in cids])
    sem = asyncio.Semaphore(8)

    async def one(cid):
        async with sem:
            await asyncio.to_thread(raw.run, cid)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(x) for x in cids))
    r["raw_per_s"] = 100 / (time.perf_counter() - t0)
    await asyncio.to_thread(raw.cleanup)
    # idle: per-process CPU over 20 s
    await asyncio.sleep(3)
    a0, t0 = all_cpu(), time.perf_counter()
    await asyncio.sleep(20)
    a1, el = all_cpu(), time.perf_counter() - t0
    busy = sorted(((k, (a1[k] - v) / el / 10) for k, v in a0.items() if k in a1), key=lambda kv: -kv[1])
    r["idle_cpu_pct_top"] = [(k, round(v, 2)) for k, v in busy[:15]]
    byname: dict[str, float] = {}
    for k, v in busy:
        nm = k.split(":", 1)[1]
        byname[nm] = byname.get(nm, 0) + v
    r["idle_cpu_pct_by_name"] = sorted(((k, round(v, 2)) for k, v in byname.items()), key=lambda kv: -kv[1])[:15]
    ex = []
    for sb in sbs[-20:]:
        t = time.perf_counter()
        await sb.run("true")
        ex.append((time.perf_counter() - t) * 1000)
    ex.sort()
    r["exec_true_p50_ms"] = ex[len(ex) // 2]
    res[label] = r
    print(label, json.dumps(r), flush=True)


async def main():
    s = BenchServer("dsec-live-"); s.prepare(["debian-python"]); s.start()
    res: dict = {}
    sbs: list = []
    try:
        async with s.client() as c:
            async for x in c.create_many(8, ARGS, concurrency=8):   # warm-up
                sbs.append(x.sandbox)
            await window(s, c, "0", sbs, res)
            while len(sbs) < N:
                async for x in c.create_many(min(250, N - len(sbs)), ARGS, concurrency=8):
                    assert x.sandbox, x.error
                    sbs.append(x.sandbox)
                print("live", len(sbs), "load1", os.getloadavg()[0], flush=True)
            await window(s, c, str(N), sbs, res)
            sem = asyncio.Semaphore(16)

            async def stop(sb):
                async with sem:
                    await sb.stop()
            await asyncio.gather(*(stop(sb) for sb in sbs))
    finally:
        s.close()
        (OUT / "result.json").write_text(json.dumps(res, indent=1))

asyncio.run(main())
