"""`python benchmarks/crun_ro.py N` (as root, after scripts/host-setup.sh): wall and CPU of one
`crun list` run as installed vs from the read-only bind at /run/dsec/crun (crun_bin.py), N each,
alternating; CPU is the children's rusage (crun's self-copy: a tmp file, two mounts, a second exec)."""
import os, resource, shutil, statistics, subprocess, sys, tempfile, time
N = int(sys.argv[1]) if len(sys.argv) > 1 else 200
state = tempfile.mkdtemp(prefix="crun-ro-")
paths = {"installed": shutil.which("crun"), "ro bind": "/run/dsec/crun"}
wall = {k: [] for k in paths}; cpu = {k: 0.0 for k in paths}
def kids(): r = resource.getrusage(resource.RUSAGE_CHILDREN); return (r.ru_utime + r.ru_stime) * 1000
for i in range(N):
    for k, p in paths.items():
        c, t = kids(), time.perf_counter()
        subprocess.run([p, "--root", state, "list", "-q"], check=True, stdout=subprocess.DEVNULL)
        wall[k].append((time.perf_counter() - t) * 1000); cpu[k] += kids() - c
shutil.rmtree(state)
print("; ".join(f"{k}: wall p50 {statistics.median(wall[k]):.2f} ms, CPU {cpu[k] / N:.2f} ms" for k in paths),
      f"| load1 {os.getloadavg()[0]:.2f}")
