"""`dsec bench fork`: N branches of one prepared sandbox, fork vs create + replay, side by side.

The set-up (a repository of --files small files written by Python, plus --setup-s seconds of
"installing": a CPU-bound loop standing in for pip's work) runs once in a parent. Then, for
each N: `fork(N)` vs N creates that each replay the set-up. Measured per arm: seconds from the
call until every branch has answered `run("true")` (fork) or finished its replay; host bytes
the branches added on the node's scratch filesystem (statvfs after a sync); host memory added
(what the branches' memory cgroups are charged). Appended to docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

from dsec.config import Paths
from dsec.sdk.client import Client, Sandbox
from dsec.types import ContainerArgs

console = Console()
IMAGE = "debian-python"
MIB = 1 << 20


def setup_script(files: int, setup_s: float) -> str:
    return ("python3 - <<'EOF'\n"
            "import os, time\n"
            f"for i in range({files}):\n"
            "    d = f'/work/repo/pkg{i // 500}'\n"
            "    os.makedirs(d, exist_ok=True)\n"
            "    open(f'{d}/mod{i}.py', 'w').write(f'# module {i}\\n' + 'x = 1\\n' * 600)\n"
            f"end = time.time() + {setup_s}\n"
            "n = 0\n"
            "while time.time() < end: n += 1\n"
            "open('/work/ready', 'w').write(str(n))\n"
            "EOF")


def _used_bytes(paths: Paths) -> int:
    os.sync()                        # delayed allocation: what was written is counted
    st = os.statvfs(paths.sandboxes)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


async def _ready(sb: Sandbox) -> None:
    r = await sb.run("true")
    if r.exit_code != 0:
        raise RuntimeError(f"{sb.id}: run('true') exited {r.exit_code}")


async def _charged_mib(sbs: list[Sandbox]) -> float:
    """What the branches' memory cgroups are charged (host_pss_mb): robust against the rest of
    a shared box, unlike MemAvailable."""
    infos = await asyncio.gather(*(s.refresh() for s in sbs))
    return sum(i.host_pss_mb or 0.0 for i in infos)


async def _fork_arm(parent: Sandbox, n: int, paths: Paths) -> dict:
    used0 = _used_bytes(paths)
    t0 = time.monotonic()
    forked = await parent.fork(n)
    kids = forked.sandboxes
    await asyncio.gather(*(_ready(k) for k in kids))
    secs = time.monotonic() - t0
    ok = await asyncio.gather(*(k.run("test -f /work/ready && ls /work/repo | wc -l") for k in kids))
    assert all(r.stdout.strip() != "0" for r in ok), "a fork lacks the set-up's files"
    used1, mem = _used_bytes(paths), await _charged_mib(kids)
    await asyncio.gather(*(k.stop() for k in kids))
    failed = [c.error for c in forked.forks if not c.ok]
    return {"n": n, "ready": len(kids), "failed": len(failed), "s": secs, "bytes": used1 - used0, "mem_mib": mem}


async def _replay_arm(c: Client, args: ContainerArgs, n: int, script: str, paths: Paths) -> dict:
    used0 = _used_bytes(paths)
    t0 = time.monotonic()
    made: list[Sandbox] = []

    async def one(created_sb: Sandbox) -> None:
        r = await created_sb.run(script, timeout_s=3600)
        if r.exit_code != 0:
            raise RuntimeError(f"replay failed in {created_sb.id}: {r.stderr[-300:]}")

    tasks = []
    async for res in c.create_many(n, args, concurrency=n):
        if res.sandbox is None:
            raise RuntimeError(f"create failed: {res.error}")
        made.append(res.sandbox)
        tasks.append(asyncio.create_task(one(res.sandbox)))
    await asyncio.gather(*tasks)
    secs = time.monotonic() - t0
    used1, mem = _used_bytes(paths), await _charged_mib(made)
    await asyncio.gather(*(s.stop() for s in made))
    return {"n": n, "ready": len(made), "failed": 0, "s": secs, "bytes": used1 - used0, "mem_mib": mem}


async def _bench(ns: list[int], files: int, setup_s: float, replay_max: int, rounds: int) -> dict:
    paths = Paths.from_env()
    args = ContainerArgs(image=IMAGE, cpu_cores=1, memory_mb=512, ttl_idle_s=3600)
    script = setup_script(files, setup_s)
    out: dict = {"fork": [], "replay": [], "load_start": os.getloadavg()[0]}
    async with Client() as c:
        parent = await c.create_container(args)
        try:
            t0 = time.monotonic()
            r = await parent.run(script, timeout_s=3600)
            if r.exit_code != 0:
                raise RuntimeError(f"set-up failed: {r.stderr[-500:]}")
            out["setup_s"] = time.monotonic() - t0
            out["setup_bytes"] = int((await parent.run("du -sb /work | cut -f1")).stdout.strip() or 0)
            console.print(f"set-up: {out['setup_s']:.1f} s, {out['setup_bytes'] / MIB:.0f} MiB in /work")
            for n in ns:
                tries = [await _fork_arm(parent, n, paths) for _ in range(rounds)]
                f = sorted(tries, key=lambda t: t["s"])[len(tries) // 2]     # the median round
                f["all_s"] = [t["s"] for t in tries]
                console.print(f"fork N={n}: {f}")
                out["fork"].append(f)
                if n <= replay_max:
                    rp = await _replay_arm(c, args, n, script, paths)
                    console.print(f"create + replay N={n}: {rp}")
                    out["replay"].append(rp)
        finally:
            await parent.stop()
    out["load_end"] = os.getloadavg()[0]
    return out


def run_fork_bench(ns: list[int], files: int, setup_s: float, replay_max: int, out: Path, note: str = "",
                   rounds: int = 3) -> dict:
    res = asyncio.run(_bench(ns, files, setup_s, replay_max, rounds))
    replay = {r["n"]: r for r in res["replay"]}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"\n## fork — {when}\n",
          f"Command: `dsec bench fork --n {','.join(map(str, ns))} --files {files} --setup-s {setup_s:g} "
          f"--rounds {rounds}` on "
          f"{os.cpu_count()} cores, kernel {platform.release()}, image `{IMAGE}`. Set-up in the parent: "
          f"{res['setup_s']:.1f} s, {res['setup_bytes'] / MIB:.0f} MiB in /work ({files} files + a "
          f"{setup_s:g} s CPU loop). Ready = every branch answered `run(\"true\")` (fork) or finished "
          "its replay (create + replay); fork: the median of " + str(rounds) + " rounds (all rounds in the "
          "column). Bytes: the node's scratch filesystem, used after a sync; memory: what the branches' "
          "memory cgroups are charged (`host_pss_mb`) while they run. 1-minute load average "
          f"{res['load_start']:.1f} at the start, {res['load_end']:.1f} at the end." + (f" {note}" if note else "") + "\n",
          "| N | fork: s to N ready (rounds) | create + replay: s | fork: host MiB written | create + replay: MiB | "
          "fork: host MiB memory | create + replay: MiB | goal |",
          "|---|---|---|---|---|---|---|---|"]
    for f in res["fork"]:
        r = replay.get(f["n"])
        rs, rb, rm = (f"{r['s']:.1f}", f"{r['bytes'] / MIB:.0f}", f"{r['mem_mib']:.0f}") if r else ("not run",) * 3
        goal = "N = 8 ready in < 1 s" if f["n"] == 8 else ""
        rounds_s = ", ".join(f"{x:.2f}" for x in f["all_s"])
        md.append(f"| {f['n']} ({f['ready']} ready, {f['failed']} failed) | {f['s']:.2f} ({rounds_s}) | {rs} | "
                  f"{f['bytes'] / MIB:.1f} | {rb} | {f['mem_mib']:.0f} | {rm} | {goal} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as fh:
        fh.write("\n".join(md) + "\n")
    console.print("\n".join(md))
    return res
