"""Kernel slab a new memory cgroup costs on this host (D35): make 200 v1 memory cgroups, diff
/proc/slabinfo after drop_caches, remove them. Run as root: python3 benchmarks/memcg_slab_probe.py"""
import os
import time
N=200
def slabs():
    d={}
    for l in open("/proc/slabinfo").readlines()[2:]:
        f=l.split(); d[f[0]]=(int(f[1]),int(f[3]))
    return d
def drop(): open("/proc/sys/vm/drop_caches","w").write("3"); time.sleep(1)
drop(); a=slabs()
for i in range(N): os.makedirs(f"/sys/fs/cgroup/memory/probe{i}")
drop(); b=slabs()
for k in sorted(b, key=lambda k: -(b[k][0]-a.get(k,(0,0))[0])*b[k][1])[:10]:
    n=(b[k][0]-a.get(k,(0,0))[0])/N; print(f"{k:24s} {n:7.1f} objs/memcg x {b[k][1]} B = {n*b[k][1]/1024:.1f} KiB")
for i in range(N): os.rmdir(f"/sys/fs/cgroup/memory/probe{i}")
