"""`dsec bench density`: how many idle sandboxes this box holds, and what each one costs, side by
side with raw `crun` in the same run, on an isolated server (own DSEC_HOME, BenchServer).

  1. baseline: MemAvailable; raw `crun run -d` of `sleep infinity` on the same image's EROFS
     rootfs (core.py's RawCrun), at the same parallelism: creations/s and MemAvailable lost per
     idle container; then they are deleted.
  2. dsec: create up to --n sandboxes (create_many), creations/s per window of 250 (does it
     degrade with n?); stops at --n or at the first refusal (quoted verbatim).
  3. idle: after settling, MemAvailable lost per idle sandbox (no drop_caches: the box is
     shared), memory charged to each sandbox's cgroup, `exec true` on 200 random sandboxes.
  4. park: suspend --park sandboxes (quiescent ones go to disk, D44; others freeze + memory to
     zram), MemAvailable per parked sandbox; resume them; the first `exec true` on the resumed
     ones; bulk suspend_all/resume_all by label when the SDK has them. Then the same group
     parked in memory, for comparison in the same run: a background `sleep` in each keeps it
     from going to disk.
  5. burst: B concurrent `create + stream("echo hi")`, create call -> first output, against B
     concurrent foreground `crun run` of `echo hi` (spawn -> first output). Cold (every create
     starts a container) is the headline; then, unless --no-burst-pool, the same burst answered
     by a warm pool of B (edge/warm_pool.py, set through the admin route and waited full).
     Beside them, the floor: the same burst as crun with dsec's containment alone (floor.py: the
     driver's config.json and nsexec replayed with `echo hi`, no server, no agent), each
     baseline burst on quiet CPUs.
  6. teardown: stop everything; nothing of the run may be left (crun containers, cgroups).

Host memory is MemAvailable as the kernel reports it (median of reads a second apart); on a
shared box a neighbour's allocations are in it too, so the load before the run is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dsec.backends.container import cgroups
from dsec.backends.container.hibernate import on_disk
from dsec.backends.container.spec import cgroup_path
from dsec.bench.core import RawCrun, _pct
from dsec.bench.floor import Kit, floor_burst, quiet, run_burst
from dsec.bench.hostmem import meminfo_mib, settled_mem_available_mib
from dsec.bench.server import BenchServer
from dsec.bench.warm_fill import wait_full
from dsec.config import Paths
from dsec.images.service import ImageService
from dsec.sdk.client import Client, Sandbox
from dsec.types import CapacityExceeded, ContainerArgs, DsecError, Unavailable

console = Console(width=None if sys.stdout.isatty() else 160)
RAW_CGROUP_PARENT = "/dsec-bench-density"
WINDOW = 250                 # creations per rate window
PRESSURE_WAIT_S = 10.0       # PSI avg10: a retry sooner sees the same average

# Goals of the density issue, for the report.
GOAL_N = 3200
GOAL_EXEC_P99_MS = 50.0
GOAL_IDLE_MIB = 0.3
GOAL_PARKED_MIB = 0.1
GOAL_BURST_X = 1.3            # issue 29: burst create -> first output p50 <= 1.3x raw `crun run`


@dataclass
class Opts:
    n: int = GOAL_N
    image: str = "debian-python"
    cpu: float = 0.005
    memory_mb: int = 48
    park: int | None = None          # None: min(1000, n)
    concurrency: int = 8
    raw_n: int = 200                 # raw crun containers for the memory/creation baseline
    burst: int = 50
    burst_pool: bool = True          # also the burst from a warm pool of its size (beside the cold one)
    exec_sample: int = 200
    settle_s: float = 5.0
    mem_reads: int = 5               # MemAvailable reads (1 s apart) per measurement, median
    pressure_retries: int = 0        # PSI refusals waited out before the fleet counts as full
    seed: int = 1

    @property
    def n_park(self) -> int:
        return min(1000, self.n) if self.park is None else self.park

    def command_line(self) -> str:
        d = Opts()
        parts = ["dsec bench density", f"--n {self.n}"]
        for name, flag in (("image", "--image"), ("cpu", "--cpu"), ("memory_mb", "--memory-mb"),
                           ("park", "--park"), ("concurrency", "--concurrency"), ("raw_n", "--raw-n"),
                           ("burst", "--burst"), ("exec_sample", "--exec-sample"),
                           ("pressure_retries", "--pressure-retries")):
            v = getattr(self, name)
            if v != getattr(d, name):
                parts.append(f"{flag} {v:g}" if isinstance(v, float) else f"{flag} {v}")
        if not self.burst_pool:
            parts.append("--no-burst-pool")
        return " ".join(parts)


def _stats(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": _pct(xs, 50) if xs else None, "p99_ms": _pct(xs, 99) if xs else None,
            "max_ms": max(xs) if xs else None}


class NoOutput(Exception):
    """A burst's sandbox whose `echo hi` ended without any stdout."""


async def create_echo(c: Client, args: ContainerArgs, created: Callable[[Sandbox], None]) -> tuple[float, float]:
    """One create -> `echo hi` -> its first stdout byte, the dsec side of a burst (`dsec bench
    density`, `dsec bench warmpool`, benchmarks/burst_ab.py): (ms to the first output, ms the
    create call took). `created` gets the sandbox as soon as it exists (to stop it later).
    Raises NoOutput, or what the create or the stream raised."""
    t0 = time.perf_counter()
    sb = await c.create(args)
    created(sb)
    t1 = time.perf_counter()
    async for ev in sb.stream("echo hi", timeout_s=120):
        if ev.type == "stdout":
            return (time.perf_counter() - t0) * 1000, (t1 - t0) * 1000
    raise NoOutput(f"{sb.id}: no stdout")


async def crun_burst(raw: Raw, cids: list[str], done: Callable[[], None] = lambda: None) -> dict:
    """The raw-crun baseline: `crun run` of the same rootfs once per id, all at once; time to
    the first line of output each, the wall time and the children's CPU (floor.run_burst),
    bundles removed after."""
    try:
        await asyncio.to_thread(lambda: [raw._bundle(cid) for cid in cids])
        return await run_burst([raw.crun("run", "--bundle", str(raw.root / "bundles" / cid), cid) for cid in cids],
                               done)
    finally:
        await asyncio.to_thread(raw.cleanup)


def _err(e: BaseException) -> str:
    """An error verbatim: its class, message and the fix it names."""
    if isinstance(e, DsecError):
        return f"{type(e).__name__}: {e.message}" + (f" (fix: {e.fix})" if e.fix else "")
    return f"{type(e).__name__}: {e}"


def _is_pressure(e: BaseException) -> bool:
    # PressureHigh reaches the client as CapacityExceeded (same code); its message names PSI
    return isinstance(e, CapacityExceeded) and " pressure: PSI " in str(e)


def _cgroup_mem_mib(rel: str) -> float | None:
    """Memory charged to one cgroup now (v1 memory.usage_in_bytes, v2 memory.current)."""
    f = cgroups.v2_dir(rel) / "memory.current" if cgroups.is_unified() else \
        cgroups.v1_dir("memory", rel) / "memory.usage_in_bytes"
    try:
        return int(f.read_text()) / 2 ** 20
    except (OSError, ValueError):
        return None


def _mean(xs: list[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return sum(ys) / len(ys) if ys else None


def _rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _load1() -> float:
    return os.getloadavg()[0]


class Raw(RawCrun):
    """core.py's raw-crun baseline, in cgroups of its own (RAW_CGROUP_PARENT), with bundles
    prepared before the clock starts and any command (the burst runs `echo hi`)."""

    def __init__(self, rootfs: Path, args: list[str] | None = None):
        super().__init__(rootfs)
        self.args = args or ["sleep", "infinity"]

    def _bundle(self, cid: str) -> Path:
        b = self.root / "bundles" / cid
        if (b / "config.json").exists():
            return b
        b = super()._bundle(cid)
        cfg = json.loads((b / "config.json").read_text())
        cfg["process"]["args"] = self.args
        cfg["linux"]["cgroupsPath"] = f"{RAW_CGROUP_PARENT}/{cid}"
        (b / "config.json").write_text(json.dumps(cfg))
        return b

    def crun(self, *args: str) -> list[str]:
        return ["crun", "--root", str(self.root / "state"), *args]

    def cleanup(self) -> None:
        # also what a failed foreground `crun run` (burst) may have left in the state dir
        if (self.root / "state").is_dir():
            left = subprocess.run(self.crun("list", "-q"), check=False, capture_output=True, text=True).stdout.split()
            self.ids.extend(c for c in left if c not in self.ids)
        super().cleanup()


def _raw_leftovers(cids: list[str]) -> list[str]:
    out = []
    for cid in cids:
        out += [str(p) for p in cgroups.leftover_dirs(f"{RAW_CGROUP_PARENT}/{cid}")]
    return out


def _remove_raw_parent() -> None:
    """The empty parent cgroup crun made for the baseline (rmdir only removes an empty one)."""
    roots = [cgroups.CGROUP_ROOT] if cgroups.is_unified() else \
        [p for p in cgroups.CGROUP_ROOT.iterdir() if p.is_dir()]
    for r in roots:
        with contextlib.suppress(OSError):
            (r / RAW_CGROUP_PARENT.lstrip("/")).rmdir()


class Bench:
    def __init__(self, c: Client, paths: Paths, o: Opts, progress: Progress, server_pid: int | None = None):
        self.c, self.paths, self.o, self.progress = c, paths, o, progress
        self.server_pid = server_pid
        self.rng = random.Random(o.seed)
        self.run_id = f"{os.getpid()}-{int(time.time())}"
        self.labels = {"dsec-bench": "density", "run": self.run_id}
        self.fleet: list[Sandbox] = []            # the idle sandboxes (phase 2 on)
        self.park_group: list[Sandbox] = []       # the first --park of them, labelled group=park
        self.extra: list[Sandbox] = []            # burst sandboxes
        self.ever: set[str] = set()               # every sandbox id the run created
        self.raw_ids: list[str] = []
        self.res: dict = {"opts": {**asdict(self.o), "n_park": self.o.n_park}}

    async def mem(self) -> float:
        return await asyncio.to_thread(settled_mem_available_mib, self.o.mem_reads)

    def phase(self, name: str) -> None:
        self.progress.console.rule(f"[bold]{name}")

    def task(self, label: str, total: int) -> int:
        return self.progress.add_task(label, total=total)

    # -- 1. raw crun baseline ----------------------------------------------------------------
    def _rootfs(self) -> Path:
        layers = ImageService(self.paths).mount_image(self.o.image)
        if len(layers) != 1:
            raise RuntimeError(f"the raw-crun baseline needs a single-layer image; {self.o.image} has {len(layers)}")
        return layers[0]

    async def raw_baseline(self) -> None:
        self.phase("1. baseline: raw crun")
        o = self.o
        m = max(1, min(o.raw_n, o.n))
        raw = Raw(self._rootfs())
        cids = [f"d{self.run_id}-{i}" for i in range(m)]
        self.raw_ids += cids
        try:
            await asyncio.to_thread(lambda: [raw._bundle(cid) for cid in cids])
            base = await self.mem()
            task = self.task(f"raw crun run -d x{m} ({o.concurrency} in parallel)", m)
            sem = asyncio.Semaphore(o.concurrency)

            async def one(cid: str) -> None:
                async with sem:
                    await asyncio.to_thread(raw.run, cid)
                    self.progress.advance(task)
            t0 = time.perf_counter()
            await asyncio.gather(*(one(cid) for cid in cids))
            dt = time.perf_counter() - t0
            await asyncio.sleep(o.settle_s)
            after = await self.mem()
            charged = _mean([_cgroup_mem_mib(f"{RAW_CGROUP_PARENT}/{cid}") for cid in cids])
        finally:
            await asyncio.to_thread(raw.cleanup)
        self.res["raw"] = {"n": m, "create_per_s": m / dt, "mem_available_before_mib": base,
                           "mem_available_after_mib": after, "mib_per_container": (base - after) / m,
                           "cgroup_charged_mib_mean": charged}

    # -- 2. dsec fleet -----------------------------------------------------------------------
    def _args(self, group: str) -> ContainerArgs:
        return ContainerArgs(image=self.o.image, cpu_cores=self.o.cpu, memory_mb=self.o.memory_mb,
                             ttl_idle_s=6 * 3600, labels={**self.labels, "group": group})

    async def create_fleet(self) -> None:
        """The first --park sandboxes are labelled group=park (bulk suspend_all selects them),
        the rest group=idle; one clock and one rate series across both."""
        self.phase(f"2. dsec: create up to {self.o.n} sandboxes")
        o = self.o
        self.res["mem_available_before_fleet_mib"] = await self.mem()
        self.res["server_rss_before_fleet_mib"] = _rss_mib(self.server_pid)
        task = self.task(f"create_many ({o.concurrency} in flight)", o.n)
        done_at: list[float] = []
        refusal: str | None = None
        pressure_waits: list[str] = []
        failures: list[str] = []
        n_failed = 0
        k_park = min(o.n_park, o.n)
        t0 = time.perf_counter()
        for group, count in (("park", k_park), ("idle", o.n - k_park)):
            got = 0
            while got < count and refusal is None:
                refused: BaseException | None = None
                async with contextlib.aclosing(self.c.create_many(count - got, self._args(group),
                                                                  concurrency=o.concurrency)) as it:
                    async for r in it:
                        if r.sandbox is not None:
                            got += 1
                            self.fleet.append(r.sandbox)
                            if group == "park":
                                self.park_group.append(r.sandbox)
                            self.ever.add(r.sandbox.id)
                            done_at.append(time.perf_counter() - t0)
                            self.progress.advance(task)
                        elif isinstance(r.error, (CapacityExceeded, Unavailable)):
                            refused = r.error
                            break
                        else:
                            n_failed += 1
                            if len(failures) < 5:
                                failures.append(_err(r.error))
                            if n_failed > max(10, o.n // 100):
                                refused = r.error
                                break
                if refused is None:
                    continue
                if _is_pressure(refused) and len(pressure_waits) < o.pressure_retries:
                    pressure_waits.append(f"at {len(self.fleet)}: {_err(refused)}")
                    self.progress.console.print(f"[yellow]refused under pressure at {len(self.fleet)}, waiting "
                                                f"{PRESSURE_WAIT_S:g} s: {refused}")
                    await asyncio.sleep(PRESSURE_WAIT_S)
                    continue
                refusal = _err(refused)
                self.progress.console.print(f"[yellow]stopped at {len(self.fleet)} sandboxes: {refusal}")
        total_s = time.perf_counter() - t0
        windows = []
        prev = 0.0
        for k in range(0, len(done_at), WINDOW):
            chunk = done_at[k:k + WINDOW]
            span = chunk[-1] - prev
            windows.append({"from": k + 1, "to": k + len(chunk), "per_s": len(chunk) / span if span > 0 else None})
            prev = chunk[-1]
        self.res["create"] = {"target": o.n, "created": len(self.fleet), "seconds": total_s,
                              "per_s": len(self.fleet) / total_s if total_s > 0 else None,
                              "windows": windows, "refusal": refusal, "pressure_waits": pressure_waits,
                              "failed": n_failed, "failures": failures, "load1_after": _load1()}

    # -- 3. idle -----------------------------------------------------------------------------
    async def _exec_true(self, sbs: list[Sandbox], label: str) -> tuple[list[float], list[str]]:
        task = self.task(label, len(sbs))
        lat, errs = [], []
        for sb in sbs:
            t0 = time.perf_counter()
            try:
                r = await sb.run("true", timeout_s=60)
                if r.exit_code != 0:
                    errs.append(f"{sb.id}: exit {r.exit_code} {r.stderr[-200:]!r}")
                else:
                    lat.append((time.perf_counter() - t0) * 1000)
            except DsecError as e:
                errs.append(f"{sb.id}: {_err(e)}")
            self.progress.advance(task)
        return lat, errs

    async def idle(self) -> None:
        self.phase(f"3. idle: {len(self.fleet)} sandboxes")
        o = self.o
        await asyncio.sleep(o.settle_s)
        after = await self.mem()
        n = max(1, len(self.fleet))
        sample = self.rng.sample(self.fleet, min(o.exec_sample, len(self.fleet)))
        charged = _mean([_cgroup_mem_mib(cgroup_path(sb.id)) for sb in sample])
        rss0, rss1 = self.res["server_rss_before_fleet_mib"], _rss_mib(self.server_pid)
        lat, errs = await self._exec_true(sample, f"exec true on {len(sample)} random idle sandboxes")
        self.res["idle"] = {"n": len(self.fleet), "mem_available_after_mib": after,
                            "mib_per_sandbox": (self.res["mem_available_before_fleet_mib"] - after) / n,
                            "cgroup_charged_mib_mean": charged,
                            "server_rss_mib_per_sandbox": (rss1 - rss0) / n if rss0 and rss1 else None,
                            "exec_true": _stats(lat), "exec_errors": errs[:5],
                            "exec_failed": len(errs), "exec_true_ms": lat}

    # -- 4. park -----------------------------------------------------------------------------
    async def _each(self, sbs: list[Sandbox], op: str | Callable[[Sandbox], Awaitable[object]],
                    label: str) -> tuple[list[float], list[str], float]:
        task = self.task(label, len(sbs))
        sem = asyncio.Semaphore(self.o.concurrency)
        lat: list[float] = []
        errs: list[str] = []

        async def one(sb: Sandbox) -> None:
            async with sem:
                t0 = time.perf_counter()
                try:
                    await (op(sb) if callable(op) else getattr(sb, op)())
                    lat.append((time.perf_counter() - t0) * 1000)
                except DsecError as e:
                    errs.append(f"{sb.id}: {_err(e)}")
                self.progress.advance(task)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(sb) for sb in sbs))
        return lat, errs, time.perf_counter() - t0

    async def park(self) -> None:
        sbs = list(self.park_group)
        k = len(sbs)
        self.phase(f"4. park: suspend and resume {k} sandboxes, one call each, then in bulk")
        if k == 0:
            self.res["park"] = {"n": 0}
            return
        o = self.o
        before = await self.mem()
        s_lat, s_errs, s_wall = await self._each(sbs, "suspend", f"suspend x{k} ({o.concurrency} in flight)")
        await asyncio.sleep(o.settle_s)
        parked = await self.mem()
        gained = (parked - before) / max(1, len(s_lat))
        to_disk = sum(on_disk(self.paths.sandboxes / sb.id / "run") for sb in sbs)
        idle_mib = self.res["idle"]["mib_per_sandbox"]
        r_lat, r_errs, r_wall = await self._each(sbs, "resume", f"resume x{k} ({o.concurrency} in flight)")
        sample = self.rng.sample(sbs, min(max(1, o.exec_sample // 2), k))
        e_lat, e_errs = await self._exec_true(sample, f"first exec true on {len(sample)} resumed sandboxes")
        await asyncio.sleep(o.settle_s)
        resumed = await self.mem()
        self.res["park"] = {
            "n": k, "to_disk": to_disk, "mem_available_before_mib": before, "mem_available_parked_mib": parked,
            "mem_available_resumed_mib": resumed,
            "freed_mib_per_parked": gained, "mib_per_parked_sandbox": idle_mib - gained,
            "suspend": {**_stats(s_lat), "wall_s": s_wall, "per_s": len(s_lat) / s_wall if s_wall else None,
                        "failed": len(s_errs), "errors": s_errs[:5]},
            "resume": {**_stats(r_lat), "wall_s": r_wall, "per_s": len(r_lat) / r_wall if r_wall else None,
                       "failed": len(r_errs), "errors": r_errs[:5]},
            "exec_after_resume": {**_stats(e_lat), "failed": len(e_errs), "errors": e_errs[:5]},
            "suspend_ms": s_lat, "resume_ms": r_lat, "exec_after_resume_ms": e_lat,
        }
        self.res["park"]["bulk"] = await self._bulk(sbs, resumed)
        self.res["park"]["in_memory"] = await self._park_in_memory(sbs)

    async def _park_in_memory(self, sbs: list[Sandbox]) -> dict:
        """The group parked the other way (frozen, memory to zram), in the same run: a
        background `sleep` in each keeps it from going to disk; its own cost is measured apart."""
        o, k = self.o, len(sbs)
        m0 = await self.mem()
        _, errs, _ = await self._each(sbs, lambda sb: sb.run("sleep 100000 > /dev/null 2>&1 &"),
                                      f"start a background sleep in {k}")
        await asyncio.sleep(o.settle_s)
        m1 = await self.mem()
        s_lat, s_errs, s_wall = await self._each(sbs, "suspend", f"suspend x{k} in memory")
        await asyncio.sleep(o.settle_s)
        parked = await self.mem()
        in_memory = sum(not on_disk(self.paths.sandboxes / sb.id / "run") for sb in sbs)
        r_lat, r_errs, r_wall = await self._each(sbs, "resume", f"resume x{k} from memory")
        await self._each(sbs, lambda sb: sb.run("kill $(grep -lx sleep /proc/[0-9]*/comm | cut -d/ -f3)"),
                         f"stop the background sleep in {k}")
        sleep_mib = (m0 - m1) / k
        freed = (parked - m1) / max(1, len(s_lat))
        return {"n": k, "in_memory": in_memory, "sleep_mib_per_sandbox": sleep_mib, "freed_mib_per_parked": freed,
                "mib_per_parked_sandbox": self.res["idle"]["mib_per_sandbox"] + sleep_mib - freed,
                "suspend": {**_stats(s_lat), "wall_s": s_wall, "failed": len(s_errs), "errors": s_errs[:5]},
                "resume": {**_stats(r_lat), "wall_s": r_wall, "failed": len(r_errs), "errors": r_errs[:5]},
                "sleep_failed": len(errs)}

    async def _bulk(self, sbs: list[Sandbox], before: float) -> dict:
        """The same group parked and resumed by label in one call each (client.suspend_all /
        resume_all), where the SDK has them."""
        sa, ra = getattr(self.c, "suspend_all", None), getattr(self.c, "resume_all", None)
        if sa is None or ra is None:
            return {"available": False}
        o = self.o
        labels = {**self.labels, "group": "park"}
        out: dict = {"available": True, "n": len(sbs), "labels": labels}
        for name, fn in (("suspend_all", sa), ("resume_all", ra)):
            task = self.task(f"{name}({labels}) of {len(sbs)}", 1)
            t0 = time.perf_counter()
            try:
                items = await fn(labels=labels)
                dt = time.perf_counter() - t0
                bad = [f"{i.id}: {i.error}" for i in items if getattr(i, "error", None)]
                states: dict[str, int] = {}
                for i in items:
                    st = getattr(getattr(i, "state", None), "value", str(getattr(i, "state", None)))
                    states[st] = states.get(st, 0) + 1
                out[name] = {"s": dt, "items": len(items), "states": states, "failed": len(bad), "errors": bad[:5]}
            except (DsecError, TypeError) as e:
                out[name] = {"error": _err(e), "s": time.perf_counter() - t0}
            self.progress.advance(task)
            if name == "suspend_all":
                await asyncio.sleep(o.settle_s)
                parked = await self.mem()
                n_ok = out[name].get("items", 0) - out[name].get("failed", 0)
                if n_ok:
                    out["freed_mib_per_parked"] = (parked - before) / n_ok
                    out["mib_per_parked_sandbox"] = self.res["idle"]["mib_per_sandbox"] - out["freed_mib_per_parked"]
        sample = self.rng.sample(sbs, min(max(1, o.exec_sample // 2), len(sbs)))
        e_lat, e_errs = await self._exec_true(sample, f"first exec true on {len(sample)} after resume_all")
        out["exec_after_resume_all"] = {**_stats(e_lat), "failed": len(e_errs), "errors": e_errs[:5]}
        # whatever resume_all left parked is resumed one by one before the burst and teardown
        await self._each(sbs, "refresh", "state after resume_all")
        still = [sb for sb in sbs if sb.info.state.value == "suspended"]
        if still:
            await self._each(still, "resume", f"resume {len(still)} left parked by resume_all")
        out["left_parked_by_resume_all"] = len(still)
        return out

    # -- 5. burst ----------------------------------------------------------------------------
    async def burst(self) -> None:
        o = self.o
        self.phase(f"5. burst: {o.burst} concurrent create -> first output, vs raw crun run")
        made_room = 0
        if self.res["create"]["refusal"] and self.fleet:
            # the node refused more: free room for the burst (it measures starts, not capacity)
            room = self.fleet[-min(len(self.fleet), 2 * o.burst):]
            await self._each(room, "stop", f"stop {len(room)} to make room for the burst")
            self.fleet = self.fleet[:-len(room)]
            made_room = len(room)
        # A whole core each, like core.py's first-output runs: a 0.005-core quota (1 ms per
        # 100 ms period) throttles bash's start-up into the next period.
        args = ContainerArgs(image=o.image, cpu_cores=1, memory_mb=256, ttl_idle_s=3600,
                             labels={**self.labels, "burst": "1"})
        cold = await self._dsec_burst(args, f"dsec: {o.burst} x create + echo hi")
        pooled = await self._pooled_burst(args) if o.burst_pool else None
        # each baseline burst starts on quiet CPUs: the previous burst's teardown (netns and cgroup
        # release in kernel workers) would otherwise land in it
        await quiet()
        raw = await self._raw_burst()
        await quiet()
        floor = await self._floor_burst()
        self.res["burst"] = {"n": o.burst, "made_room_by_stopping": made_room, "dsec": cold, "raw": raw,
                             "floor": floor, **({"pooled": pooled} if pooled is not None else {})}

    async def _dsec_burst(self, args: ContainerArgs, label: str,
                          after: Callable[[], Awaitable[None]] | None = None) -> dict:
        """B concurrent create -> `echo hi` -> first stdout; `after` run once they all answered,
        then the sandboxes are stopped."""
        task = self.task(label, self.o.burst)
        ttfo, create_ms, errs = [], [], []

        def created(sb: Sandbox) -> None:
            self.extra.append(sb)
            self.ever.add(sb.id)

        async def one() -> None:
            try:
                first_ms, call_ms = await create_echo(self.c, args, created)
                ttfo.append(first_ms)
                create_ms.append(call_ms)
            except NoOutput as e:
                errs.append(str(e))
            except DsecError as e:
                errs.append(_err(e))
            self.progress.advance(task)
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(self.o.burst)))
        wall = time.perf_counter() - t0
        if after is not None:
            await after()
        await self._each(self.extra, "stop", "stop the burst sandboxes")
        self.extra = []
        return {**_stats(ttfo), "wall_s": wall, "create_p50_ms": _pct(create_ms, 50) if create_ms else None,
                "failed": len(errs), "errors": errs[:5], "ttfo_ms": ttfo}

    async def _pooled_burst(self, args: ContainerArgs) -> dict:
        """The same burst answered by a warm pool of its size: the pool is set, waited full (at
        most 120 s, or until it reports a failed start: a full node) and left to settle, as a node configured for bursts of this shape would be;
        then set back to none (before the burst's sandboxes stop: no refill meanwhile). `claimed`
        says how many of the burst's creates the pool answered."""
        o = self.o
        self.phase(f"5b. burst from a warm pool of {o.burst}")
        try:
            await self.c.set_warm_pools(f"{o.image}:{o.burst}")
            # a failed start (e.g. admission refused one): burst from what is there
            fill_s, fill_error = await wait_full(self.c, o.image, o.burst, 120, stop_on_error=True)
            await asyncio.sleep(self.o.settle_s)     # the fill's starts done: the pool has waited
            before = (await self.c.warm_pools()).claims
            claimed: list[int] = []

            async def empty_pool() -> None:
                claimed.append((await self.c.warm_pools()).claims - before)
                await self.c.set_warm_pools("")
            res = await self._dsec_burst(args, f"dsec: {o.burst} x create + echo hi, warm pool", empty_pool)
        finally:
            await self.c.set_warm_pools("")
        return {**res, "claimed": claimed[0] if claimed else None, "pool_fill_s": fill_s, "pool_error": fill_error}

    async def _raw_burst(self) -> dict:
        o = self.o
        raw = Raw(self._rootfs(), ["echo", "hi"])
        cids = [f"b{self.run_id}-{i}" for i in range(o.burst)]
        self.raw_ids += cids
        task = self.task(f"raw: {o.burst} x crun run echo hi", o.burst)
        return await crun_burst(raw, cids, lambda: self.progress.advance(task))

    async def _floor_burst(self) -> dict:
        """The same burst as crun with dsec's containment alone (floor.py: the driver's bundle
        and nsexec replayed with `echo hi`, no server, no agent): what containment costs crun."""
        task = self.task(f"crun + dsec's containment: {self.o.burst} x echo hi", self.o.burst)
        kit = await asyncio.to_thread(Kit, self.paths, self._rootfs())
        return await floor_burst(kit, self.o.burst, "full", tag=f"f{self.run_id}-",
                                 done=lambda: self.progress.advance(task))

    # -- 6. teardown -------------------------------------------------------------------------
    async def teardown(self) -> None:
        self.phase(f"6. teardown: stop {len(self.fleet) + len(self.extra)} sandboxes")
        sbs = self.fleet + self.extra
        lat, errs, wall = await self._each(sbs, "stop", f"stop x{len(sbs)}")
        self.fleet, self.extra = [], []
        leaks = await asyncio.to_thread(self._leaks)
        await asyncio.sleep(self.o.settle_s)
        self.res["teardown"] = {"n": len(sbs), "wall_s": wall, "per_s": len(lat) / wall if wall else None,
                                "failed": len(errs), "errors": errs[:5], "leaks": leaks,
                                "mem_available_after_mib": await self.mem()}

    def _leaks(self) -> dict:
        crun_left: list[str] = []
        if self.paths.crun_root.exists():
            ids = subprocess.run(["crun", "--root", str(self.paths.crun_root), "list", "-q"],
                                 check=False, capture_output=True, text=True).stdout.split()
            crun_left = sorted(set(ids) & self.ever)
        cg_left = [str(p) for sid in sorted(self.ever) for p in cgroups.leftover_dirs(cgroup_path(sid))]
        raw_left = _raw_leftovers(self.raw_ids)
        _remove_raw_parent()
        return {"crun_containers": crun_left, "sandbox_cgroups": cg_left, "raw_cgroups": raw_left}

    async def live_left(self) -> list[str]:
        """Sandboxes of this run the server still reports live."""
        return [i.id for i in await self.c.list() if i.labels.get("run") == self.run_id]

    async def emergency_stop(self) -> None:
        sbs = self.fleet + self.extra
        if sbs:
            self.progress.console.print(f"[red]stopping the {len(sbs)} sandboxes still held")
            await self._each(sbs, "stop", "emergency stop")
            self.fleet, self.extra = [], []


def make_progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console)


async def bench(c: Client, paths: Paths, o: Opts, progress: Progress | None = None,
                server_pid: int | None = None) -> dict:
    """Every phase against the server `c` talks to, whose DSEC_HOME is `paths` (the raw-crun
    baseline mounts the image from it; the leak check reads its crun state). `server_pid`:
    its process, whose memory growth per sandbox is reported apart."""
    progress = progress or make_progress()
    t0 = time.perf_counter()
    with progress:
        b = Bench(c, paths, o, progress, server_pid)
        b.res["load1_before"] = _load1()
        b.res["host"] = {"cores": os.cpu_count(), "kernel": platform.release(),
                         "mem_total_mib": meminfo_mib("MemTotal"), "swap_total_mib": meminfo_mib("SwapTotal")}
        # the node's automatic warm pools (D99) off for the run: the fleet's creates are a burst
        # of one shape, and every row here is cold unless it says it is pooled; restored after
        auto_before = (await c.warm_pools()).auto_max
        await c.set_warm_pools(None, auto=0)
        try:
            await b.raw_baseline()
            await b.create_fleet()
            await b.idle()
            await b.park()
            await b.burst()
            await b.teardown()
        finally:
            await b.emergency_stop()
            await c.set_warm_pools(None, auto=auto_before)
        b.res["live_left"] = await b.live_left()
    b.res["seconds"] = time.perf_counter() - t0
    b.res["finished_utc"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return b.res


def measure(o: Opts, json_path: Path | None) -> dict:
    """Run the benchmark on an isolated server; the results (also written to json_path)."""
    server = BenchServer("dsec-bench-density-")
    res: dict = {}
    try:
        with console.status(f"building {o.image} and starting an isolated server in {server.home}"):
            server.prepare([o.image])
            server.start()

        async def go() -> dict:
            async with server.client() as c:
                return await bench(c, server.paths, o, server_pid=server.proc.pid if server.proc else None)
        res = asyncio.run(go())
    finally:
        leaked_qemu = server.close()
        home_left = server.home.exists()
    res["home_removed"] = not home_left
    if leaked_qemu:
        res["leaked_qemu"] = leaked_qemu
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=1, default=str))
        console.print(f"raw numbers: {json_path}")
    return res
