"""N rollouts of the SWE-like episode of examples/swerex_episode.py through SWE-ReX's API: on dsec
(DsecDeployment) and, side by side in the same run, on a SWE-ReX deployment of its own:
DockerDeployment where a docker daemon answers, else LocalDeployment (commands straight on this
host in a pty: no isolation and no sandbox to create, the floor any sandbox is measured against).

    python benchmarks/swerex_rollouts.py --n 20                 # the local dsec (DSEC_URL/DSEC_API_KEY else)
    python benchmarks/swerex_rollouts.py --n 20 --baseline docker --docker-image python:3.11

A rollout is deployment start + episode + stop; the two kinds alternate so that noise on the
node hits both. Then one session command (`true`) 50 times: through the dsec SDK alone, through
the adapter, and on the baseline. Prints p50/p95 per phase, the episodes that did not end fixed (a runtime that
misreported an exit code or output), and the dsec/baseline ratio of the medians; with
--concurrency C it also runs C dsec rollouts at a time and reports rollouts per second.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from swerex.deployment.abstract import AbstractDeployment
from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from swerex_episode import run_episode


def docker_status() -> str | None:
    """None if a docker daemon answers, else why not."""
    if shutil.which("docker") is None:
        return "no docker binary"
    r = subprocess.run(["docker", "info"], check=False, capture_output=True, text=True, timeout=20)
    return None if r.returncode == 0 else f"docker daemon not answering: {r.stderr.strip()[:200]}"


async def rollout(make: Callable[[], AbstractDeployment]) -> dict[str, float]:
    d = make()
    t0 = time.perf_counter()
    await d.start()
    t1 = time.perf_counter()
    try:
        reward = (await run_episode(d)).reward
    except Exception as e:   # counted, not fatal: the baseline has failed by its own 1 s limits here
        print(f"  episode failed on {type(d).__name__}: {e!r}"[:300])
        reward = 0.0
    finally:
        t2 = time.perf_counter()
        await d.stop()
        t3 = time.perf_counter()
    return {"start": t1 - t0, "episode": t2 - t1, "stop": t3 - t2, "total": t3 - t0, "reward": reward}


async def timed(aw: Awaitable[object]) -> float:
    t0 = time.perf_counter()
    await aw
    return time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(name: str, rows: list[dict[str, float]]) -> dict[str, float]:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "reward"}
    cells = "  ".join(f"{k} {med[k] * 1000:7.1f} / {pct([r[k] for r in rows], 0.95) * 1000:7.1f}" for k in med)
    # a rollout whose episode failed or did not end fixed: the runtime reported something wrong
    wrong = sum(r["reward"] != 1.0 for r in rows)
    print(f"  {name:<16} {cells}   (ms, p50 / p95, n={len(rows)}, wrong episodes {wrong})")
    return med


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20, help="rollouts of each kind")
    ap.add_argument("--image", default="debian-python", help="dsec image")
    ap.add_argument("--concurrency", type=int, default=1, help="also run this many dsec rollouts at a time")
    ap.add_argument("--baseline", choices=["auto", "local", "docker"], default="auto")
    ap.add_argument("--docker-image", default="python:3.11", help="image for --baseline docker (needs swe-rex inside "
                                                                   "or pipx and network, as SWE-ReX does)")
    args = ap.parse_args()

    from swerex.deployment.config import DockerDeploymentConfig, LocalDeploymentConfig

    from dsec.adapters.swerex import DsecDeploymentConfig

    dsec_cfg = DsecDeploymentConfig(image=args.image, memory_mb=512, ttl_idle_s=300)
    why_not_docker = docker_status() if args.baseline != "local" else "not asked for"
    if args.baseline == "docker" and why_not_docker:
        sys.exit(f"--baseline docker: {why_not_docker}")
    if args.baseline == "docker" or (args.baseline == "auto" and not why_not_docker):
        base_name, base_cfg = "swerex docker", DockerDeploymentConfig(image=args.docker_image)
    else:
        base_name, base_cfg = "swerex local", LocalDeploymentConfig()
        print(f"baseline: SWE-ReX LocalDeployment (docker: {why_not_docker})")

    await rollout(dsec_cfg.get_deployment)          # warm-up: image mount, client, caches
    await rollout(base_cfg.get_deployment)
    dsec_rows, base_rows = [], []
    for _ in range(args.n):
        dsec_rows.append(await rollout(dsec_cfg.get_deployment))
        base_rows.append(await rollout(base_cfg.get_deployment))
    print(f"{args.n} sequential rollouts each (start + episode of 11 runtime calls + stop):")
    d = report("dsec", dsec_rows)
    b = report(base_name, base_rows)
    print(f"  ratio dsec/{base_name.split()[1]} of p50: total {d['total'] / b['total']:.2f}x, "
          f"episode {d['episode'] / b['episode']:.2f}x")

    # one session command: what the adapter adds over the SDK, and the baseline's own cost
    calls = {}
    d_dep, b_dep = dsec_cfg.get_deployment(), base_cfg.get_deployment()
    await d_dep.start()
    await b_dep.start()
    try:
        from dsec import Client
        async with Client(dsec_cfg.url, dsec_cfg.api_key) as c:
            sb = await c.get(d_dep.sandbox_id)
            await sb.run("true", session="raw")
            calls["dsec SDK sb.run(session=)"] = [await timed(sb.run("true", session="raw")) for _ in range(50)]
        for name, dep in (("dsec adapter", d_dep), (base_name, b_dep)):
            await dep.runtime.create_session(CreateBashSessionRequest(startup_timeout=10))
            calls[f"{name} run_in_session"] = [await timed(dep.runtime.run_in_session(BashAction(command="true")))
                                               for _ in range(50)]
    finally:
        await d_dep.stop()
        await b_dep.stop()
    print("one session command (`true`), 50 calls each:")
    for name, xs in calls.items():
        print(f"  {name:<36} p50 {statistics.median(xs) * 1000:6.1f} ms  p95 {pct(xs, 0.95) * 1000:6.1f} ms")

    if args.concurrency > 1:
        sem = asyncio.Semaphore(args.concurrency)

        async def one() -> dict[str, float]:
            async with sem:
                return await rollout(dsec_cfg.get_deployment)

        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one() for _ in range(args.n)))
        wall = time.perf_counter() - t0
        report(f"dsec x{args.concurrency}", list(rows))
        print(f"  dsec, {args.concurrency} at a time: {args.n / wall:.2f} rollouts/s "
              f"(sequential: {1 / d['total']:.2f}/s)")


if __name__ == "__main__":
    asyncio.run(main())
