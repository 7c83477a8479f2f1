"""`PYTHONPATH=src python benchmarks/store_batch.py ROUNDS BURST`: the control-store writes of a burst
of BURST creates (idempotency claim, quota reservation, its activation, the claim's bind: what
the apiserver writes per create) on a real SQLite IAM store in a temp dir, BURST creates at once,
each write in its own thread hop (`to_thread`, before D97) vs through store/batch.py; alternating
rounds. Reports the process's CPU (utime+stime) per create and the burst's wall time, medians."""
import asyncio
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dsec.iam import IAM
from dsec.store.batch import batcher
from dsec.store.idempotency import IdempotencyClaims

ROUNDS, BURST = int(sys.argv[1]), int(sys.argv[2])

def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime

async def burst(iam: IAM, claims: IdempotencyClaims, project: str, tag: str, batched: bool) -> tuple[float, float]:
    b = batcher(iam.db)
    call = b.call if batched else asyncio.to_thread
    async def one(i: int) -> None:
        c = await call(claims.claim, project, f"{tag}-{i}")
        rid = await call(iam.quotas.reserve, project, 0.5, 64)
        await asyncio.sleep(0)                       # the edge's create would run here
        await call(iam.quotas.activate, rid, f"sb-n.{tag}{i}")
        await call(claims.bind, project, f"{tag}-{i}", c.token, f"sb-n.{tag}{i}")
    c0, t0 = cpu(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(BURST)))
    return (cpu() - c0) / BURST * 1000, (time.perf_counter() - t0) * 1000

async def main() -> None:
    d = Path(tempfile.mkdtemp(prefix="dsec-i29cold-batch-", dir="/var/tmp"))
    with IAM(d / "iam.db") as iam:
        iam.bootstrap(d / "admin.key")
        p = iam.create_project("bench", iam.root().id, max_sandboxes=10**6, max_cpu_cores=10**6,
                               max_memory_mb=10**9).id
        claims = IdempotencyClaims(iam.db)
        res: dict[str, list[tuple[float, float]]] = {"thread hops": [], "batched": []}
        for r in range(ROUNDS + 1):
            for name in (res if r % 2 == 0 else reversed(list(res))):
                out = await burst(iam, claims, p, f"r{r}{name[0]}", name == "batched")
                if r:                                   # round 0 warms both
                    res[name].append(out)
        for name, xs in res.items():
            print(f"{name:>11}: CPU {statistics.median(x[0] for x in xs):.3f} ms/create "
                  f"(min {min(x[0] for x in xs):.3f} max {max(x[0] for x in xs):.3f}), burst wall "
                  f"{statistics.median(x[1] for x in xs):.1f} ms; {ROUNDS} rounds of {BURST}")
    shutil.rmtree(d)


asyncio.run(main())
