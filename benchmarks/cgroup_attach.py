"""`python benchmarks/cgroup_attach.py N [GAP_S]` (as root): what crun does per create on a cgroup v1/hybrid host
(a new directory and a cgroup.procs write in every hierarchy for a fresh process), timed per write
and per create, GAP_S apart (default 0.05: the kernel idle between creates, as for a lone create).
Prints whether a cgroup mount has favordynmods (scripts/host-setup.sh, D92)."""
import os, sys, time, statistics
R = "/sys/fs/cgroup"
hier = [h for h in sorted(os.listdir(R)) if os.path.isdir(f"{R}/{h}") and not os.path.islink(f"{R}/{h}")]
N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
GAP = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
FAVOR = any("favordynmods" in l.split()[5] + " " + l.split(" - ")[1] for l in open("/proc/self/mountinfo") if " - cgroup" in l)
per, tot = [], []
for i in range(N):
    time.sleep(GAP)
    pid = os.fork()
    if pid == 0:
        os.read(os.open("/dev/null", os.O_RDONLY), 1); time.sleep(5); os._exit(0)
    t0 = time.perf_counter()
    for h in hier:
        d = f"{R}/{h}/cgbench-{os.getpid()}-{i}"
        os.mkdir(d)
        if h == "cpuset":
            for k in ("cpuset.cpus", "cpuset.mems"): open(f"{d}/{k}", "w").write(open(f"{R}/{h}/{k}").read())
        t = time.perf_counter()
        with open(f"{d}/cgroup.procs", "w") as f: f.write(str(pid))
        per.append((time.perf_counter() - t) * 1000)
    tot.append((time.perf_counter() - t0) * 1000)
    os.kill(pid, 9); os.waitpid(pid, 0)
    for h in hier: os.rmdir(f"{R}/{h}/cgbench-{os.getpid()}-{i}")
print(f"favordynmods {FAVOR}: hierarchies {len(hier)}: per write p50 {statistics.median(per):.3f} max {max(per):.2f} ms; per create (all) p50 {statistics.median(tot):.2f} p90 {sorted(tot)[int(.9*N)]:.2f} ms; load1 {os.getloadavg()[0]:.2f}")
