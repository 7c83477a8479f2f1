"""`dsec bench vm-density --idle-ab`: what idle microVM clones cost the host's CPU, two codes or
settings side by side (issue 31).

Two isolated servers (sides) each hold K idle busybox clones at the same time, so both see the
same neighbours; then, in W windows of S seconds, the CPU time (utime + stime from /proc) of
every clone's QEMU is read at the window's start and end: % of one core per idle clone, median
over windows. After the windows, `run("true")` on every clone, the two sides alternating clone
by clone (p50/p99), and each side's guest clocksource (one clone asked). With a KSM side the
host's ksmd runs (put back after).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from dsec import procstat
from dsec.bench.server import BenchServer
from dsec.bench.vmdensity import CONFIGS, NO_DOZE, Opts, _one, _pct, ksm_set, smaps_breakdown
from dsec.sdk.client import Client, Sandbox

console = Console()
CLOCKSOURCE = "/sys/devices/system/clocksource/clocksource0/current_clocksource"


def qemu_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used; 0.0 once it is gone."""
    try:
        return procstat.cpu_s(pid)
    except OSError:
        return 0.0


@dataclass
class Side:
    name: str
    env: dict[str, str]
    ksmd: bool = False
    server: BenchServer | None = None
    sbs: list[Sandbox] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    idle_pct: list[float] = field(default_factory=list)     # per window: mean % of a core per clone
    idle_max_pct: list[float] = field(default_factory=list)  # per window: the busiest clone's
    rtt_ms: list[float] = field(default_factory=list)
    clocksource: str = "?"
    mem_kib: dict[str, float] = field(default_factory=dict)   # per clone, after the windows


def side(key: str, baseline_src: str | None) -> Side:
    """`baseline` (the code at baseline_src, its defaults), `this` (this code, its defaults) or
    a vm-density configuration name (this code with its settings)."""
    if key == "baseline":
        if not baseline_src:
            raise RuntimeError("the baseline side needs --baseline-src (the src dir of the old checkout)")
        return Side("baseline checkout", {"PYTHONPATH": baseline_src})
    if key == "this":     # awake: an idle clone that dozes (DSEC_VM_IDLE_STOP) uses no CPU to measure
        return Side("this checkout", dict(NO_DOZE))
    if "=" in key:        # this code with settings of its own: A=1+B=2
        env = dict(kv.split("=", 1) for kv in key.split("+"))
        return Side(" ".join(f"{a}={b}" for a, b in env.items()), env, env.get("DSEC_VM_KSM", "all") != "0")
    cfg = CONFIGS[key]
    return Side(cfg.name, dict(cfg.env), cfg.ksmd)


async def _fill(s: Side, c: Client, o: Opts, k: int) -> None:
    assert s.server is not None
    await (await _one(c, o))[0].stop()          # the template build: not counted
    sem = asyncio.Semaphore(o.inflight)

    async def go() -> None:
        async with sem:
            s.sbs.append((await _one(c, o))[0])
    await asyncio.gather(*(go() for _ in range(k)))
    seen: dict[str, int] = {}          # every clone's (a template's verdict is every clone's)
    for sb in s.sbs:
        cs = (await sb.run(f"cat {CLOCKSOURCE}")).stdout.strip() or "?"
        seen[cs] = seen.get(cs, 0) + 1
    s.clocksource = ", ".join(f"{cs} ×{n}" for cs, n in sorted(seen.items()))
    s.pids = [int((s.server.paths.vm_sandboxes / sb.id / "qemu.pid").read_text()) for sb in s.sbs]


async def _windows(sides: list[Side], windows: int, window_s: float) -> None:
    for _ in range(windows):
        c0 = {id(s): [qemu_cpu_s(p) for p in s.pids] for s in sides}
        t0 = time.monotonic()
        await asyncio.sleep(window_s)
        dt = time.monotonic() - t0
        for s in sides:
            used = [qemu_cpu_s(p) - a for p, a in zip(s.pids, c0[id(s)])]
            s.idle_pct.append(100 * statistics.fmean(used) / dt)
            s.idle_max_pct.append(100 * max(used) / dt)
        console.print("  ".join(f"{s.name}: {s.idle_pct[-1]:.3f}%" for s in sides))


async def _exec_alternating(sides: list[Side]) -> None:
    for i in range(max(len(s.sbs) for s in sides)):
        for s in (sides if i % 2 == 0 else list(reversed(sides))):
            if i < len(s.sbs):
                t = time.perf_counter()
                await s.sbs[i].run("true")
                s.rtt_ms.append((time.perf_counter() - t) * 1000)


async def _stop(s: Side) -> None:
    sem = asyncio.Semaphore(8)

    async def stop(sb: Sandbox) -> None:
        async with sem:
            await sb.stop()
    await asyncio.gather(*(stop(sb) for sb in s.sbs), return_exceptions=True)


async def _measure(sides: list[Side], o: Opts, k: int, windows: int, window_s: float) -> float:
    """Fill every side, measure; returns the load average while measuring."""
    clients = [s.server.client() for s in sides if s.server is not None]
    try:
        for c in clients:
            await c.__aenter__()
        try:
            for s, c in zip(sides, clients):
                await _fill(s, c, o, k)
            await asyncio.sleep(5)                  # the clones' first-command work settles
            load = os.getloadavg()[0]
            await _windows(sides, windows, window_s)
            for s in sides:
                parts = [smaps_breakdown(p, o.memory_mb) for p in s.pids if Path(f"/proc/{p}").exists()]
                s.mem_kib = {key: statistics.fmean(b.get(key, 0.0) for b in parts) for key in parts[0]} if parts else {}
            await _exec_alternating(sides)
        finally:
            for s in sides:
                await _stop(s)
    finally:
        for c in clients:
            await c.__aexit__(None, None, None)
    return load


def run_idle_ab(o: Opts, keys: list[str], k: int, windows: int, window_s: float, out: Path | None) -> list[Side]:
    if k < 1 or windows < 1 or window_s <= 0:
        raise ValueError("--idle-k and --idle-windows must be >= 1 and --idle-window-s > 0")
    sides = [side(key, o.baseline_src) for key in keys]
    load_before = os.getloadavg()[0]
    old_ksm: dict[str, int] = {}
    leaked: list[int] = []
    try:
        for s in sides:
            s.server = BenchServer("dsec-bench-vmi-")
            s.server.env.update(s.env)
            s.server.prepare([o.image])
            s.server.start()
        if any(s.ksmd for s in sides):
            old_ksm = ksm_set({"pages_to_scan": o.pages_to_scan, "run": 1})
        load_mid = asyncio.run(_measure(sides, o, k, windows, window_s))
    finally:
        if old_ksm:
            ksm_set({"run": old_ksm["run"]})
            ksm_set({"pages_to_scan": old_ksm["pages_to_scan"]})
        for s in sides:
            if s.server is not None:
                leaked += s.server.close()
    if leaked:
        raise RuntimeError(f"QEMU processes outlived the bench (killed now): {leaked}")
    md = ["", f"Idle clones side by side: `dsec bench vm-density --idle-ab {','.join(keys)} --idle-k {k} "
          f"--idle-windows {windows} --idle-window-s {window_s:g}"
          + (" --baseline-src OLD/src" if o.baseline_src else "") + f"` ({k} idle busybox clones of "
          f"{o.memory_mb} MiB per side, all {len(sides) * k} alive at once; load average (1 min) before / "
          f"while measuring / after {load_before:.2f} / {load_mid:.2f} / {os.getloadavg()[0]:.2f}).", "",
          "| side | guest clocksource (clones) | idle CPU per clone, % of a core (median of windows) | each window | "
          "busiest clone | "
          "`run(\"true\")` p50 / p99 ms, sides alternating | PSS per clone MiB (code cache / QEMU anon / KSM) |",
          "|---|---|---|---|---|---|---|"]

    def mib(s: Side, k: str) -> str:
        return f"{s.mem_kib.get(k, 0.0) / 1024:.1f}"
    md += [f"| {s.name} | {s.clocksource} | {statistics.median(s.idle_pct):.3f} | "
           f"{', '.join(f'{x:.3f}' for x in s.idle_pct)} | {statistics.median(s.idle_max_pct):.3f} | {_pct(s.rtt_ms, 50):.1f} / {_pct(s.rtt_ms, 99):.1f} | "
           f"{mib(s, 'pss')} ({mib(s, 'code_cache')} / {mib(s, 'qemu_anon')} / {mib(s, 'ksm')}) |"
           for s in sides]
    md += ["", "Settings per side: " + "; ".join(
        f"{s.name}: `{' '.join(f'{a}={b}' for a, b in s.env.items() if a != 'PYTHONPATH')}`" for s in sides)]
    console.print("\n".join(md))
    if out is not None:
        with out.open("a") as f:
            f.write("\n".join(md) + "\n")
    return sides
