"""The exec path's server CPU, several `dsec up` servers side by side (issue 26 item 6).

    PYTHONPATH=src .venv/bin/python benchmarks/exec_cost_ab.py BLOCKS N NAME:SRC:OBS[:ENV,ENV] ...

Each arm is a server process running the dsec at SRC (a `git archive` of another commit's
src/ gives old code) with DSEC_OBSERVABILITY=OBS (and ENV=1 for each extra name), holding
one 1-core busybox sandbox. BLOCKS times, each arm runs N sequential `exec true` (the order
reverses every block); the server's CPU per exec is its threads' run time from
/proc/PID/task/*/schedstat (ns). Name two processes per arm (new_on1, new_on2, ...) to
average out a process's own bias (a few %);
the last line is JSON with every block's figure."""
import asyncio, subprocess, sys, tempfile, time, os, statistics, json
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import observability_cost as oc
from dsec.testing.isolated import ServerProcess, cleanup_home, link_node_downloads

BLOCKS, N = int(sys.argv[1]), int(sys.argv[2])
ARMS = {}   # name -> (src, env)
for a in sys.argv[3:]:
    name, src, obs, *x = a.split(":")
    ARMS[name] = (src, {"DSEC_OBSERVABILITY": obs, **{v: "1" for v in (x[0].split(",") if x else [])}})

def cpu_ns(pid):
    t = 0
    for d in os.listdir(f"/proc/{pid}/task"):
        try: t += int(Path(f"/proc/{pid}/task/{d}/schedstat").read_text().split()[0])
        except OSError: pass
    return t

async def main(servers):
    from dsec import Client
    cl, sb = {}, {}
    for k, s in servers.items():
        cl[k] = Client(s.url, s.key); await cl[k].__aenter__()
        sb[k] = await cl[k].create_container(**{**oc.ARGS, "cpu_cores": 1.0, "memory_mb": 64})
        for _ in range(100): await sb[k].run("true")
    cpu = {k: [] for k in servers}; lat = {k: [] for k in servers}
    names = list(servers)
    for b in range(BLOCKS):
        order = names if b % 2 == 0 else names[::-1]
        for k in order:
            pid = servers[k].proc.pid
            c0 = cpu_ns(pid)
            for _ in range(N):
                t = time.perf_counter(); await sb[k].run("true"); lat[k].append((time.perf_counter() - t) * 1000)
            cpu[k].append((cpu_ns(pid) - c0) / N / 1e6)
        print(f"block {b+1}/{BLOCKS} load {os.getloadavg()[0]:.1f} " + " ".join(f"{k}={cpu[k][-1]:.3f}" for k in names), flush=True)
    for k in names:
        await sb[k].stop(); await cl[k].__aexit__(None, None, None)
    res = {k: {"cpu_med": statistics.median(cpu[k]), "cpu_mean": statistics.fmean(cpu[k]), "p50": statistics.median(lat[k]),
               "p99": oc.pct(lat[k], 0.99), "blocks": [round(x, 4) for x in cpu[k]]} for k in names}
    return res

homes = {k: Path(tempfile.mkdtemp(prefix=f"dsec-cost2-{k}-", dir="/var/tmp")) for k in ARMS}
servers = {}
try:
    for k, home in homes.items():
        src, env = ARMS[k]
        link_node_downloads(home)
        subprocess.run([sys.executable, "-m", "dsec", "image", "build", "busybox", "--builtin"],
                       env={**ServerProcess(home).env, "PYTHONPATH": src}, check=True, capture_output=True)
        servers[k] = ServerProcess(home, {**oc.NO_PSI, **oc.IDMAP, "DSEC_VM": "0", "PYTHONPATH": src, **env})
        servers[k].start(120)
    l0 = os.getloadavg()
    res = asyncio.run(main(servers))
    print("load start", l0, "end", os.getloadavg())
    base = {k: v for k, v in res.items()}
    for k, v in res.items():
        print(f"{k:8s} cpu/exec median {v['cpu_med']:.4f} ms mean {v['cpu_mean']:.4f}  p50 {v['p50']:.3f} p99 {v['p99']:.2f}")
    names = list(res)
    ref = names[1]
    for k in names:
        r = [a / b for a, b in zip(res[k]["blocks"], res[ref]["blocks"])]
        print(f"{k:8s} paired ratio to {ref}: median {statistics.median(r):.4f} mean {statistics.fmean(r):.4f}")
    # arms named X_on1, X_on2, ... against X_off1, X_off2, ...: per block, the mean over each
    # group's processes, then the median of the paired on/off ratios
    groups: dict[str, list[str]] = {}
    for k in names:
        groups.setdefault(k.rstrip("0123456789"), []).append(k)
    per = {g: [statistics.fmean(res[k]["blocks"][i] for k in ks) for i in range(BLOCKS)] for g, ks in groups.items()}
    for g in per:
        if g.endswith("_on") and (off := g[:-3] + "_off") in per:
            r = [a / b for a, b in zip(per[g], per[off])]
            d = [a - b for a, b in zip(per[g], per[off])]
            print(f"{g}/{off}: paired median {statistics.median(r):.4f} (mean {statistics.fmean(r):.4f}), "
                  f"{1000 * statistics.median(d):+.1f} us per exec")
    print(json.dumps(res))
finally:
    for k, s in servers.items():
        s.kill(15, timeout_s=120)
    for home in homes.values():
        cleanup_home(home)
