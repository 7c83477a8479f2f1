"""Before/after: the same simulation (160 nodes, 380K live, 5,000/s, 2 s) with the placer
before D34 and with the current one (docs/benchmarks.md, cluster-sim). First:

    git show 9d7b3e5:src/dsec/placement/placer.py > /tmp/placer_before.py
    .venv/bin/python benchmarks/cluster_sim_before_after.py
"""
import importlib.util, sys
import dsec.bench.cluster_sim as cs
spec = importlib.util.spec_from_file_location("placer_before", "/tmp/placer_before.py")
old = importlib.util.module_from_spec(spec); sys.modules["placer_before"] = old; spec.loader.exec_module(old)
o = cs.Opts(duration_s=2.0, policies=("p2",))
import asyncio
new_res = asyncio.run(cs.run_policy(o, cs.POLICIES["p2"]))
cs.Placer = old.Placer
old_res = asyncio.run(cs.run_policy(o, cs.POLICIES["p2"]))
for name, r in (("before (HEAD)", old_res), ("after", new_res)):
    print(f"| {name} | {len(r.decide_ns)} | {r.pct(r.decide_ns,.5)/1000:.1f} | {r.pct(r.decide_ns,.99)/1000:.1f} | "
          f"{r.pct(r.decide_cpu_ns,.5)/1000:.1f} | {r.pct(r.decide_cpu_ns,.99)/1000:.1f} | "
          f"{sum(r.decide_cpu_ns)/len(r.decide_cpu_ns)/1000:.1f} | {max(r.imbalances()):.3f} | {r.cpu_s:.1f} |")
