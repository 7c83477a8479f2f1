"""`dsec bench vm`: VM sandboxes started as clones of a template snapshot vs cold boots, side by
side in one run, on an isolated server (own DSEC_HOME: the templates are built in the run).

  1. create -> first `sb.run("true")` done: the one-off template build (first clone), then N
     cold boots and N clones interleaved one by one (sequential), then a burst of B of each in
     parallel. The create call and the first `true` are also reported apart: a restored TCG
     guest has an empty translation cache, so its first command pays for re-translating the
     guest code it runs (KVM runs guest code natively and has no such cost).
  2. host memory of idle VMs: K clones alive at once, then K cold boots: PSS of each QEMU
     (SandboxInfo.host_pss_mb) and the MemAvailable lost per VM.
  3. exec round trip of `true` on a warm sandbox: microvm clone, microvm cold, q35 vm, and a
     container of the same image as the baseline.
  4. q35 `vm` (virtio-pmem + DAX): create -> first command, clone vs cold.

Every VM started is stopped; the run fails loudly if a QEMU of the bench home outlives it.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dsec.bench.server import BenchServer
from dsec.sdk.client import Client, Sandbox
from dsec.bench.hostmem import settled_mem_available_mib

console = Console()
IDLE_CONCURRENCY = 2     # creations in flight while filling the idle groups (2 cores here)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def _smaps_pss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@dataclass
class Start:
    """One sandbox from the create call to its first command done."""

    create_ms: float
    first_ms: float
    second_ms: float
    sandbox_id: str

    @property
    def total_ms(self) -> float:
        return self.create_ms + self.first_ms


class Live:
    """Every sandbox the bench holds, so that a failure anywhere still stops them all."""

    def __init__(self) -> None:
        self.sbs: dict[str, Sandbox] = {}
        self.accels: set[str] = set()

    def add(self, sb: Sandbox) -> Sandbox:
        self.sbs[sb.id] = sb
        if sb.info.accel:
            self.accels.add(sb.info.accel)
        return sb

    async def stop(self, sbs: list[Sandbox] | None = None) -> None:
        todo = list(self.sbs.values()) if sbs is None else sbs
        sem = asyncio.Semaphore(8)

        async def one(sb: Sandbox) -> None:
            async with sem:
                try:
                    await sb.stop()
                finally:
                    self.sbs.pop(sb.id, None)
        results = await asyncio.gather(*(one(sb) for sb in todo), return_exceptions=True)
        errs = [r for r in results if isinstance(r, BaseException)]
        if errs:
            console.print(f"[yellow]{len(errs)} stops failed, first: {errs[0]!r}")


Make = Callable[[], Awaitable[Sandbox]]


async def _start(live: Live, make: Make, *, keep: bool = False) -> tuple[Start, Sandbox]:
    t0 = time.perf_counter()
    sb = live.add(await make())
    t1 = time.perf_counter()
    r1 = await sb.run("true")
    t2 = time.perf_counter()
    r2 = await sb.run("true")
    t3 = time.perf_counter()
    if r1.exit_code != 0 or r2.exit_code != 0:
        raise RuntimeError(f"`true` failed in {sb.id}: {r1} {r2}")
    if not keep:
        await live.stop([sb])
    return Start((t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000, sb.id), sb


def _templates_built(server: BenchServer) -> list[float]:
    """Seconds of each 'vm template built' event in the server log, in order."""
    out = []
    for line in server.log_tail(10 ** 8).splitlines():
        if '"vm template built"' in line:
            try:
                out.append(float(json.loads(line)["seconds"]))
            except (ValueError, KeyError):
                pass
    return out


def _vm_started(server: BenchServer) -> dict[str, float]:
    """sandbox id -> seconds the VM driver took to start it ('vm started' events): the part of
    the create call spent in QEMU (cold boot, or qemu-img + launch + incoming migration)."""
    out = {}
    for line in server.log_tail(10 ** 8).splitlines():
        if '"vm started"' in line:
            try:
                ev = json.loads(line)
                out[ev["sandbox"]] = float(ev["seconds"]) * 1000
            except (ValueError, KeyError):
                pass
    return out


def _summary(starts: list[Start]) -> dict:
    tot = [s.total_ms for s in starts]
    return {"n": len(starts), "p50_ms": _pct(tot, 50), "p95_ms": _pct(tot, 95),
            "ids": [s.sandbox_id for s in starts],
            "create_p50_ms": _pct([s.create_ms for s in starts], 50),
            "first_p50_ms": _pct([s.first_ms for s in starts], 50),
            "second_p50_ms": _pct([s.second_ms for s in starts], 50)}


async def _template(server: BenchServer, live: Live, make: Make) -> dict:
    """The first clone of an environment builds its template (cold boot + snapshot) in-line."""
    before = len(_templates_built(server))
    st, _ = await _start(live, make)
    built = _templates_built(server)[before:]
    return {"first_clone_ms": st.total_ms, "build_s": built[0] if built else float("nan")}


async def _sequential(live: Live, makes: dict[str, Make], n: int, progress: Progress, label: str) -> dict:
    """n of each way, interleaved, so that both see the same load on the node."""
    task = progress.add_task(label, total=n * len(makes))
    res: dict[str, list[Start]] = {k: [] for k in makes}
    for _ in range(n):
        for k, make in makes.items():
            res[k].append((await _start(live, make))[0])
            progress.advance(task)
    return {k: _summary(v) for k, v in res.items()}


async def _burst(live: Live, make: Make, n: int) -> dict:
    t0 = time.perf_counter()
    got = await asyncio.gather(*(_start(live, make, keep=True) for _ in range(n)))
    wall = time.perf_counter() - t0
    await live.stop([sb for _, sb in got])
    return {**_summary([s for s, _ in got]), "wall_s": wall}


async def _idle_group(server: BenchServer, live: Live, make: Make, n: int, idle_s: float,
                      progress: Progress, label: str) -> dict:
    base = await asyncio.to_thread(settled_mem_available_mib)
    task = progress.add_task(label, total=n)
    sem = asyncio.Semaphore(IDLE_CONCURRENCY)

    async def one() -> Sandbox:
        async with sem:
            _, sb = await _start(live, make, keep=True)
            progress.advance(task)
            return sb
    sbs = await asyncio.gather(*(one() for _ in range(n)))
    await asyncio.sleep(idle_s)
    after = await asyncio.to_thread(settled_mem_available_mib)
    pss, direct = [], []
    for sb in sbs:
        info = await sb.refresh()
        pss.append(info.host_pss_mb or float("nan"))
        # cross-check the platform's number against the kernel's, read here
        pid = int((server.paths.vm_sandboxes / sb.id / "qemu.pid").read_text())
        direct.append(_smaps_pss_mib(pid) or float("nan"))
    await live.stop(sbs)
    return {"n": n, "pss_mean_mib": statistics.fmean(pss), "pss_sum_mib": sum(pss),
            "smaps_pss_mean_mib": statistics.fmean(direct),
            "memavail_total_mib": base - after, "memavail_per_vm_mib": (base - after) / n}


async def _exec_rtt(live: Live, make: Make, n: int, progress: Progress, label: str) -> dict:
    _, sb = await _start(live, make, keep=True)
    for _ in range(5):          # warm-up: translation cache, sessions, connections
        await sb.run("true")
    task = progress.add_task(label, total=n)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await sb.run("true")
        lat.append((time.perf_counter() - t0) * 1000)
        progress.advance(task)
    await live.stop([sb])
    return {"n": n, "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99)}


async def _bench(server: BenchServer, c: Client, o: "Opts") -> dict:
    live = Live()
    kw = {"image": o.image, "memory_mb": o.memory_mb, "vcpus": o.vcpus}

    def micro(clone: bool) -> Make:
        return lambda: c.create_microvm(clone=clone, **kw)

    def q35(clone: bool) -> Make:
        return lambda: c.create_vm(clone=clone, **kw)
    out: dict = {}
    try:
        with Progress(console=console) as progress:
            t = progress.add_task("microvm template build (first clone)", total=None)
            out["tpl"] = await _template(server, live, micro(True))
            progress.update(t, total=1, completed=1)
            out["seq"] = await _sequential(live, {"clone": micro(True), "cold": micro(False)}, o.n,
                                           progress, f"microvm: {o.n} clones + {o.n} cold boots, one at a time")
            t = progress.add_task(f"microvm: bursts of {o.burst} in parallel", total=2)
            out["burst"] = {}
            for k, clone in (("clone", True), ("cold", False)):
                out["burst"][k] = await _burst(live, micro(clone), o.burst)
                progress.advance(t)
            out["idle"] = {}
            for k, clone in (("clone", True), ("cold", False)):
                out["idle"][k] = await _idle_group(server, live, micro(clone), o.n_idle, o.idle_s, progress,
                                                   f"microvm: {o.n_idle} idle {k}s")
            # before the exec step: its q35 clone would build the q35 template
            if o.n_vm > 0:
                t = progress.add_task("q35 template build (first clone)", total=None)
                out["q35_tpl"] = await _template(server, live, q35(True))
                progress.update(t, total=1, completed=1)
                out["q35_seq"] = await _sequential(live, {"clone": q35(True), "cold": q35(False)}, o.n_vm,
                                                   progress, f"q35 vm: {o.n_vm} clones + {o.n_vm} cold boots")
            out["exec"] = {}
            ways = {"microvm clone": micro(True), "microvm cold": micro(False), "q35 vm clone": q35(True),
                    "container": lambda: c.create_container(image=o.image, memory_mb=o.memory_mb)}
            for k, make in ways.items():
                out["exec"][k] = await _exec_rtt(live, make, o.n_exec, progress, f"exec `true` x{o.n_exec}: {k}")
    finally:
        await live.stop()
    out["accel"] = sorted(live.accels)
    # attach the driver's share of each create call, then drop the ids (not worth a report)
    started = _vm_started(server)
    for group in [*out.get("seq", {}).values(), *out.get("burst", {}).values(), *out.get("q35_seq", {}).values()]:
        group["driver_p50_ms"] = _pct([started[i] for i in group.pop("ids") if i in started], 50)
    for group in out.get("idle", {}).values():
        group.pop("ids", None)
    return out


@dataclass
class Opts:
    n: int = 10
    burst: int = 4
    n_idle: int = 20
    idle_s: float = 5.0
    n_exec: int = 200
    n_vm: int = 3
    memory_mb: int = 256
    vcpus: int = 1
    image: str = "busybox"

    def command(self) -> str:
        return (f"dsec bench vm --n {self.n} --burst {self.burst} --n-idle {self.n_idle} --idle-s {self.idle_s:g} "
                f"--n-exec {self.n_exec} --n-vm {self.n_vm} --memory-mb {self.memory_mb} --vcpus {self.vcpus} "
                f"--image {self.image}")


def _ms(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _rows(r: dict, o: Opts) -> list[tuple[str, str, str, str, str]]:
    s, b, i = r["seq"], r["burst"], r["idle"]
    rows = [
        ("template build, one-off s (first clone -> first command s)",
         f"{r['tpl']['build_s']:.2f} ({r['tpl']['first_clone_ms'] / 1000:.2f})", "-", "", ""),
        (f"create -> first `true` done, p50 / p95 ms (n={o.n}, one at a time)",
         f"{_ms(s['clone']['p50_ms'])} / {_ms(s['clone']['p95_ms'])}",
         f"{_ms(s['cold']['p50_ms'])} / {_ms(s['cold']['p95_ms'])}",
         f"{s['cold']['p50_ms'] / s['clone']['p50_ms']:.1f}x faster", "clone >= 10x faster"),
        ("  of which: create call p50 ms", _ms(s["clone"]["create_p50_ms"]), _ms(s["cold"]["create_p50_ms"]), "", ""),
        ("    of which: QEMU launched (clone: + restored) p50 ms", _ms(s["clone"]["driver_p50_ms"]),
         _ms(s["cold"]["driver_p50_ms"]), "", ""),
        ("  of which: first `true` p50 ms", _ms(s["clone"]["first_p50_ms"]), _ms(s["cold"]["first_p50_ms"]), "", ""),
        ("second `true` p50 ms", _ms(s["clone"]["second_p50_ms"]), _ms(s["cold"]["second_p50_ms"]), "", ""),
        (f"burst of {o.burst} in parallel: per VM p50 / p95 ms, all done s",
         f"{_ms(b['clone']['p50_ms'])} / {_ms(b['clone']['p95_ms'])}, {b['clone']['wall_s']:.2f}",
         f"{_ms(b['cold']['p50_ms'])} / {_ms(b['cold']['p95_ms'])}, {b['cold']['wall_s']:.2f}",
         f"{b['cold']['wall_s'] / b['clone']['wall_s']:.1f}x faster", ""),
        (f"PSS per idle VM, {o.n_idle} alive, mean MiB (sum)",
         f"{i['clone']['pss_mean_mib']:.1f} ({i['clone']['pss_sum_mib']:.0f})",
         f"{i['cold']['pss_mean_mib']:.1f} ({i['cold']['pss_sum_mib']:.0f})",
         f"{100 * i['clone']['pss_mean_mib'] / i['cold']['pss_mean_mib']:.0f}%", "clone <= 25% of cold"),
        (f"MemAvailable lost per idle VM, MiB (all {o.n_idle})",
         f"{i['clone']['memavail_per_vm_mib']:.1f} ({i['clone']['memavail_total_mib']:.0f})",
         f"{i['cold']['memavail_per_vm_mib']:.1f} ({i['cold']['memavail_total_mib']:.0f})",
         f"{100 * i['clone']['memavail_per_vm_mib'] / i['cold']['memavail_per_vm_mib']:.0f}%", ""),
    ]
    return rows


def _exec_rows(r: dict) -> list[tuple[str, str, str]]:
    return [(k, _ms(v["p50_ms"]), _ms(v["p99_ms"])) for k, v in r["exec"].items()]


def _q35_rows(r: dict, o: Opts) -> list[tuple[str, str, str, str]]:
    if "q35_seq" not in r:
        return []
    s = r["q35_seq"]
    return [("template build, one-off s (first clone -> first command s)",
             f"{r['q35_tpl']['build_s']:.2f} ({r['q35_tpl']['first_clone_ms'] / 1000:.2f})", "-", ""),
            (f"create -> first `true` done, p50 / p95 ms (n={o.n_vm})",
             f"{_ms(s['clone']['p50_ms'])} / {_ms(s['clone']['p95_ms'])}",
             f"{_ms(s['cold']['p50_ms'])} / {_ms(s['cold']['p95_ms'])}",
             f"{s['cold']['p50_ms'] / s['clone']['p50_ms']:.1f}x faster"),
            ("  of which: QEMU launched (clone: + restored) p50 ms", _ms(s["clone"]["driver_p50_ms"]),
             _ms(s["cold"]["driver_p50_ms"]), ""),
            ("  of which: first `true` p50 ms", _ms(s["clone"]["first_p50_ms"]), _ms(s["cold"]["first_p50_ms"]), "")]


def _table(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    t = Table(*head, title=title)
    for row in rows:
        t.add_row(*row)
    return t


def _md(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    return [f"| {' | '.join(head)} |", "|" + "---|" * len(head)] + [f"| {' | '.join(r)} |" for r in rows]


def _load1() -> float:
    return os.getloadavg()[0]


def run_vm_bench(o: Opts, out: Path) -> dict:
    server = BenchServer("dsec-bench-vm-")
    load_before = _load1()
    try:
        with console.status(f"building images ({o.image}) and starting an isolated server in {server.home}"):
            server.prepare(sorted({o.image, "busybox"}))
            server.start()

        async def go() -> dict:
            async with server.client() as c:
                nodes = await c.nodes()
                if "microvm" not in nodes[0].backends:
                    raise RuntimeError("the node offers no VM backends: fetch the guest kernel first "
                                       "(`dsec vm fetch-kernel`)")
                return await _bench(server, c, o)
        res = asyncio.run(go())
    finally:
        leaked = server.close()
    if leaked:
        raise RuntimeError(f"QEMU processes outlived the bench (killed now): {leaked}")
    accel = "/".join(res["accel"]) or "?"
    main_head = ("metric", "microvm clone", "microvm cold", "clone vs cold", "goal")
    exec_head = ("sandbox (warm)", "exec `true` p50 ms", "p99 ms")
    q35_head = ("q35 vm (virtio-pmem + DAX)", "clone", "cold", "clone vs cold")
    rows, erows, qrows = _rows(res, o), _exec_rows(res), _q35_rows(res, o)
    console.print(_table(f"microvm, accel={accel}, image {o.image}, {o.memory_mb} MiB", main_head, rows))
    console.print(_table(f"exec round trip, n={o.n_exec}", exec_head, erows))
    if qrows:
        console.print(_table("q35 vm", q35_head, qrows))
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"\n## vm — {when}\n",
          f"Command: `{o.command()}` on {os.cpu_count()} cores, kernel {platform.release()}, "
          f"accelerator **{accel}**, image `{o.image}`, guests of {o.memory_mb} MiB and {o.vcpus} vCPU; an isolated "
          "server (own DSEC_HOME: the templates are built in the run). Ready = the create call returned and "
          "`sb.run(\"true\")` finished. Clones and cold boots run interleaved one at a time, then as bursts; "
          f"the idle groups are filled {IDLE_CONCURRENCY} at a time, held {o.idle_s:g} s, PSS read per QEMU. "
          f"Load average (1 min) before / after the run: {load_before:.2f} / {_load1():.2f}.\n"]
    md += _md(main_head, rows)
    md += ["", f"Exec round trip of `true` on a warm sandbox, {o.n_exec} sequential calls, client-observed "
           f"(container: same image, same memory limit):", ""] + _md(exec_head, erows)
    if qrows:
        md += ["", "q35 `vm`, create -> first `true`, clones and cold boots interleaved:", ""] + _md(q35_head, qrows)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write("\n".join(md) + "\n")
    console.print(f"appended to {out}; raw: {json.dumps(res)}")
    return res
