"""Waking a dozing microVM clone: `run("true")` on an idle clone whose vCPUs were stopped (D91,
D100), two code trees side by side in one run.

Two isolated servers, one per source tree (PYTHONPATH), each with K busybox clones that doze
after DSEC_RECLAIM_IDLE_S. Each round waits until every clone of both sides is stopped (QMP
query-status), then wakes them one at a time, alternating sides, timing `run("true")`: the
host's noise falls on both sides alike. Prints p50/p99 per side and the ratio. Each clone runs
one untimed `true` before its first doze (as in `dsec bench vm-density`).

    python benchmarks/wake_ab.py --old /path/to/old/src --new src --k 20 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import time
from pathlib import Path

from dsec.bench.server import BenchServer
from dsec.sdk.client import Client, Sandbox


def qmp_status(home: Path, sandbox_id: str) -> str:
    """QEMU's run state over the clone's QMP socket (one short connection)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(home / "vm" / "sb" / sandbox_id / "qmp.sock"))
        f = s.makefile("rwb")
        f.readline()
        for cmd in ("qmp_capabilities", "query-status"):
            f.write(json.dumps({"execute": cmd}).encode() + b"\n")
            f.flush()
            while True:
                msg = json.loads(f.readline())
                if "return" in msg or "error" in msg:
                    break
        return str(msg["return"]["status"])


async def all_dozing(srv: BenchServer, sbs: list[Sandbox], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        states = await asyncio.gather(*(asyncio.to_thread(qmp_status, srv.home, sb.id) for sb in sbs))
        if all(s == "paused" for s in states):
            return True
        await asyncio.sleep(1.0)
    return False


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main_async(a: argparse.Namespace) -> None:
    sides = {"old": str(Path(a.old).resolve()), "new": str(Path(a.new).resolve())}
    env = {"DSEC_RECLAIM_IDLE_S": str(a.idle_s), "DSEC_RECLAIM_PRESSED_IDLE_S": str(a.idle_s),
           "DSEC_RECLAIM_PER_TICK": "8", "DSEC_WARM_POOL_AUTO": "0"}
    servers: dict[str, BenchServer] = {}
    clients: dict[str, Client] = {}
    sbs: dict[str, list[Sandbox]] = {}
    times: dict[str, list[float]] = {k: [] for k in sides}
    try:
        for name, src in sides.items():
            srv = BenchServer(prefix=f"dsec-wake-{name}-")
            srv.env.update(env, PYTHONPATH=src)
            srv.prepare(["busybox"])
            srv.start()
            servers[name] = srv
            clients[name] = await srv.client().__aenter__()
            first = await clients[name].create_microvm(image="busybox", memory_mb=256)   # the template, untimed
            sbs[name] = [first] + [await clients[name].create_microvm(image="busybox", memory_mb=256)
                                   for _ in range(a.k - 1)]
            # one command each before the first doze, as vm-density's clones: the first `true`
            # after a restore translates busybox's code (~100 ms), which is not a wake's cost (D102)
            for sb in sbs[name]:
                await sb.run("true")
            print(f"{name}: {a.k} clones on {src}", flush=True)
        for r in range(a.rounds):
            for name in sides:
                if not await all_dozing(servers[name], sbs[name], a.idle_s + 60):
                    raise RuntimeError(f"{name}: not every clone dozed within {a.idle_s + 60:.0f} s")
            for i in range(a.k):
                for name in (("old", "new") if (i + r) % 2 == 0 else ("new", "old")):
                    t0 = time.perf_counter()
                    res = await sbs[name][i].run("true")
                    times[name].append((time.perf_counter() - t0) * 1000)
                    if res.exit_code != 0:
                        raise RuntimeError(f"{name}: run(true) exited {res.exit_code}")
            print(f"round {r + 1}: " + ", ".join(f"{n} p50 {statistics.median(times[n]):.1f} ms" for n in sides),
                  flush=True)
    finally:
        for name, c in clients.items():
            await asyncio.gather(*(sb.stop() for sb in sbs.get(name, [])), return_exceptions=True)
            await c.__aexit__(None, None, None)
        for srv in servers.values():
            left = srv.close()
            if left:
                print(f"killed {len(left)} QEMUs left by {srv.home}")
    o, n = times["old"], times["new"]
    print(f"\nwake run(true), {a.k} clones x {a.rounds} rounds a side, load {os.getloadavg()[0]:.1f}:")
    for name, xs in times.items():
        print(f"  {name}: p50 {pct(xs, 0.5):.1f} ms, p99 {pct(xs, 0.99):.1f} ms (n={len(xs)})")
    print(f"  new/old p50 {pct(n, 0.5) / pct(o, 0.5):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="src dir of the baseline tree")
    p.add_argument("--new", required=True, help="src dir of the tree measured")
    p.add_argument("--k", type=int, default=20, help="clones a side")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-s", type=float, default=4.0, help="DSEC_RECLAIM_IDLE_S of both servers")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
