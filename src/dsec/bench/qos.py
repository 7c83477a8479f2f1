"""`dsec bench qos`: a latency-sensitive agent's step latency alone, beside best-effort load of
the same class (unprotected) and beside the same load as cpu_class="batch" (protected), side by
side in one run (docs/decisions.md D27, backends/container/qos.py).

One latency sandbox runs an "agent step" loop: a short sleep (the agent waiting for its model),
then a fixed piece of CPU-bound Python work (~20 ms alone, calibrated at the start), timed inside
the sandbox with perf_counter, N steps. Load: one sandbox per core of the node, each running a
duty-cycled worker (busy `busy_ms` of its own CPU time, then sleep `idle_ms`): 50% duty x one
worker per core = ~50% of the node's CPU capacity asked for. Two sets of load sandboxes exist,
one created with cpu_class="latency", one with cpu_class="batch"; only one set runs at a time.
Modes run interleaved in short rounds (each mode first in turn) so that drift of a shared
machine (here: the VM's vCPUs switch between ~15 and ~25 ms per step for seconds at a time,
whatever runs in the guest) hits every mode alike. The baseline is the `alone` mode of the same run.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dsec.backends.container import cgroups, qos
from dsec.backends.container.spec import cgroup_path
from dsec.bench.server import BenchServer

console = Console()
IMAGE = "debian-python"
# creates happen before any load; PSI admission would still see a shared box's neighbours
NO_PSI_ADMISSION = {f"DSEC_ADMIT_PSI_{k}": "100" for k in ("CPU_SOME", "MEMORY_SOME", "MEMORY_FULL", "IO_FULL")}
MODES = ("alone", "unprotected", "protected")
LABELS = {"alone": "alone", "unprotected": "beside 50% load, same class (latency)",
          "protected": "beside 50% load, cpu_class=batch"}

STEP = r"""
import json, sys, time
iters, n, gap = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) / 1000
def step():
    x = 0
    for i in range(iters):
        x += i * i % 7
    return x
out = []
for _ in range(n):
    time.sleep(gap)
    t = time.perf_counter()
    step()
    out.append((time.perf_counter() - t) * 1000)
print(json.dumps(out))
"""

LOAD = r"""
import sys, time
busy, idle = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
print("started", flush=True)
while True:
    t = time.thread_time()
    while time.thread_time() - t < busy:
        pass
    time.sleep(idle)
"""


@dataclass(frozen=True)
class Opts:
    steps: int = 25             # per mode per round
    rounds: int = 20
    step_ms: float = 20.0       # target duration of one step, alone
    gap_ms: float = 10.0        # sleep before each step
    busy_ms: float = 10.0       # load worker: CPU time per cycle ...
    idle_ms: float = 10.0       # ... then sleep (50% duty)
    load_sandboxes: int = 0     # per class; 0: one per core

    def n_load(self) -> int:
        return self.load_sandboxes or os.cpu_count() or 1

    def command(self) -> str:
        return (f"dsec bench qos --steps {self.steps} --rounds {self.rounds} --step-ms {self.step_ms:g} "
                f"--gap-ms {self.gap_ms:g} --busy-ms {self.busy_ms:g} --idle-ms {self.idle_ms:g}"
                + (f" --load-sandboxes {self.load_sandboxes}" if self.load_sandboxes else ""))


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def _cpu_ns(sid: str) -> int:
    """CPU time used so far by a sandbox's cgroup (v1 cpuacct.usage, v2 cpu.stat usage_usec)."""
    if cgroups.is_unified():
        for line in (cgroups.v2_dir(cgroup_path(sid)) / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) * 1000
        return 0
    return int((cgroups.v1_dir("cpuacct", cgroup_path(sid)) / "cpuacct.usage").read_text())


async def _steps(ls, iters: int, n: int, gap_ms: float) -> list[float]:
    r = await ls.run(f"python3 /tmp/step.py {iters} {n} {gap_ms:g}", timeout_s=600)
    if r.exit_code != 0:
        raise RuntimeError(f"step loop failed: {r.stderr[-500:]}")
    return json.loads(r.stdout)


async def _calibrate(ls, o: Opts) -> int:
    iters = 100_000
    for _ in range(3):
        ms = sorted(await _steps(ls, iters, 7, o.gap_ms))[3]
        iters = max(1000, int(iters * o.step_ms / ms))
    return iters


async def _with_load(load: list, o: Opts, measure) -> tuple[list[float], float]:
    """Run `measure` while every sandbox in `load` runs a worker; returns its result and the
    CPU the load got meanwhile, as a fraction of the node's capacity."""
    if not load:
        return await measure(), 0.0
    execs = [await sb.start(f"python3 /tmp/load.py {o.busy_ms:g} {o.idle_ms:g}", timeout_s=600) for sb in load]
    try:
        await asyncio.sleep(0.3)   # workers running (their python started)
        before = [_cpu_ns(sb.id) for sb in load]
        t0 = time.monotonic()
        res = await measure()
        wall = time.monotonic() - t0
        used = sum(_cpu_ns(sb.id) - b for sb, b in zip(load, before)) / 1e9
    finally:
        for sb, ex in zip(load, execs):
            await sb.signal(ex.exec_id, signal.SIGKILL)
        for sb, ex in zip(load, execs):
            await sb.attach(ex.exec_id)
    return res, used / wall / (os.cpu_count() or 1)


async def _bench(c, o: Opts) -> dict:
    ls = await c.create_container(image=IMAGE, cpu_cores=1.0, memory_mb=256, cpu_class="latency")
    sets: dict[str, list] = {"unprotected": [], "protected": []}
    try:
        for mode, cls in (("unprotected", "latency"), ("protected", "batch")):
            for _ in range(o.n_load()):
                sb = await c.create_container(image=IMAGE, cpu_cores=1.0, memory_mb=128, cpu_class=cls)
                sets[mode].append(sb)
                await sb.files.write("/tmp/load.py", LOAD)
        await ls.files.write("/tmp/step.py", STEP)
        iters = await _calibrate(ls, o)
        steps: dict[str, list[float]] = {m: [] for m in MODES}
        load: dict[str, list[float]] = {m: [] for m in MODES}
        p50s: dict[str, list[float]] = {m: [] for m in MODES}     # per round, for paired ratios
        for r in range(o.rounds):
            for mode in MODES[r % 3:] + MODES[:r % 3]:     # each mode first in turn
                res, frac = await _with_load(sets.get(mode, []), o, lambda: _steps(ls, iters, o.steps, o.gap_ms))
                steps[mode] += res
                load[mode].append(frac)
                p50s[mode].append(_pct(res, 50))
                console.print(f"round {r + 1}/{o.rounds} {mode:12s} p50 {_pct(res, 50):6.2f} ms  "
                              f"p99 {_pct(res, 99):6.2f} ms  load {100 * frac:4.1f}% of node")
        return {"iters": iters, "steps": steps, "load": {m: sum(v) / len(v) for m, v in load.items()},
                "round_p50": p50s}
    finally:
        for sb in [ls, *sets["unprotected"], *sets["protected"]]:
            try:
                await sb.stop()
            except Exception as e:       # noqa: BLE001 - the server's cleanup removes it anyway
                console.print(f"[yellow]stop {sb.id}: {e}")


def _rows(res: dict) -> list[tuple[str, ...]]:
    s = res["steps"]
    base50, base99 = _pct(s["alone"], 50), _pct(s["alone"], 99)
    base_mean = sum(s["alone"]) / len(s["alone"])
    rows: list[tuple[str, ...]] = []
    for m in MODES:
        p50, p99, mean = _pct(s[m], 50), _pct(s[m], 99), sum(s[m]) / len(s[m])
        if m == "alone":
            incs = ("—", "—", "—", "—", "—")
        else:
            paired = sorted(x / a for x, a in zip(res["round_p50"][m], res["round_p50"]["alone"]))
            incs = (*(f"{100 * (v / b - 1):+.1f}%" for v, b in ((p50, base50), (p99, base99), (mean, base_mean))),
                    f"{100 * (paired[len(paired) // 2] - 1):+.1f}%",
                    f"{100 * res['load'][m]:.0f}%")
        rows.append((LABELS[m], str(len(s[m])), f"{p50:.2f}", f"{p99:.2f}", f"{mean:.2f}", *incs))
    return rows


HEAD = ("LS agent step", "steps", "p50 ms", "p99 ms", "mean ms", "p50 vs alone", "p99 vs alone",
        "mean vs alone", "median of per-round p50 ratios", "CPU the load got (of node)")


def _host() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    v = "v2" if cgroups.is_unified() else "v1"
    cs = "available" if qos.core_sched_supported() else "not available (CONFIG_SCHED_CORE unset / no SMT)"
    return (f"{os.cpu_count()} cores ({model}), kernel {platform.release()}, cgroup {v}, core scheduling {cs}")


def _batch_means() -> str:
    return ("cgroup cpu.weight 1 + cpu.idle + SCHED_IDLE" if cgroups.is_unified()
            else "cgroup cpu.shares 2 + SCHED_IDLE")


def run_qos_bench(o: Opts, out: Path) -> dict:
    server = BenchServer("dsec-bench-qos-")
    server.env.update(NO_PSI_ADMISSION)
    load_before = os.getloadavg()[0]
    t_start = time.monotonic()
    try:
        with console.status(f"building {IMAGE} and starting an isolated server in {server.home}"):
            server.prepare([IMAGE])
            server.start()

        async def go() -> dict:
            async with server.client() as c:
                return await _bench(c, o)
        res = asyncio.run(go())
    finally:
        server.close()
    load_after = os.getloadavg()[0]
    rows = _rows(res)
    t = Table(*HEAD, title=f"LS step latency ({o.step_ms:g} ms of Python alone, {o.gap_ms:g} ms gap)")
    for row in rows:
        t.add_row(*row)
    console.print(t)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"\n## qos: CPU QoS classes, LS step latency beside best-effort load — {when}\n",
          (f"Command: `{o.command()}` ({time.monotonic() - t_start:.0f} s) on {_host()}; an isolated server. "
          f"One latency sandbox (cpu_cores=1) runs agent steps: {o.gap_ms:g} ms sleep, then {res['iters']} "
          f"iterations of Python arithmetic (~{o.step_ms:g} ms alone), timed inside the sandbox. Load: "
          f"{o.n_load()} other sandboxes (cpu_cores=1 each), each one worker busy {o.busy_ms:g} ms of CPU then "
          f"idle {o.idle_ms:g} ms (asks for ~50% of the node); unprotected: created with cpu_class=\"latency\", "
          f"protected: cpu_class=\"batch\" ({_batch_means()}). {o.rounds} rounds of {o.steps} "
          f"steps per mode, modes interleaved; baseline = `alone` of the same run. Load average (1 min) "
          f"before / after: {load_before:.2f} / {load_after:.2f}. Reference system: +45.2% unprotected, "
          "+17.3% protected; goal: protected <= +10%.\n"),
          "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write("\n".join(md) + "\n")
    console.print(f"appended to {out}")
    return res
