"""`dsec bench core`: the platform against raw crun, side by side in one run.

Measures, on this machine: creation throughput through the SDK vs `crun run -d` of the same
rootfs at the same parallelism; exec round trip of `true` through the SDK vs `crun exec`; host
memory per idle sandbox (MemAvailable delta / n) vs idle raw crun containers; time from the
create call to the first output of a command. Results are appended to docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from dsec.config import Paths
from dsec.images.service import ImageService
from dsec.sdk.client import Client
from dsec.types import ContainerArgs
from dsec.bench.hostmem import settled_mem_available_mib

console = Console()
IMAGE = "debian-python"
PARALLEL = 2


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


@dataclass
class RawCrun:
    """The baseline: plain `crun run -d` of `sleep` on the same (read-only) rootfs."""

    rootfs: Path
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dsec-bench-crun-")))
    ids: list[str] = field(default_factory=list)

    def _bundle(self, cid: str) -> Path:
        b = self.root / "bundles" / cid
        b.mkdir(parents=True)
        subprocess.run(["crun", "spec"], cwd=b, check=True)
        cfg = json.loads((b / "config.json").read_text())
        cfg["process"]["terminal"] = False
        cfg["process"]["args"] = ["sleep", "infinity"]
        cfg["root"] = {"path": str(self.rootfs), "readonly": True}
        cfg["linux"]["cgroupsPath"] = f"/dsec-bench/{cid}"
        (b / "config.json").write_text(json.dumps(cfg))
        return b

    def run(self, cid: str) -> None:
        b = self._bundle(cid)
        # the container inherits crun's stdio: never give it a pipe we would wait on
        with open(b / "crun.log", "wb") as log:
            subprocess.run(["crun", "--root", str(self.root / "state"), "run", "-d", "--bundle", str(b), cid],
                           check=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.ids.append(cid)

    def exec_true(self, cid: str) -> None:
        subprocess.run(["crun", "--root", str(self.root / "state"), "exec", cid, "true"], check=True)

    def cleanup(self) -> None:
        for cid in self.ids:
            subprocess.run(["crun", "--root", str(self.root / "state"), "delete", "-f", cid],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ids.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def _raw_create(raw: RawCrun, n: int, prefix: str) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(raw.run, [f"{prefix}{i}" for i in range(n)]))
    return time.perf_counter() - t0


async def _sdk_create(c: Client, n: int, args: ContainerArgs, progress: Progress, label: str) -> tuple[float, list]:
    task = progress.add_task(label, total=n)
    t0 = time.perf_counter()
    sbs, errors = [], []
    async for res in c.create_many(n, args, concurrency=PARALLEL):
        if res.sandbox:
            sbs.append(res.sandbox)
        else:
            errors.append(res.error)
        progress.advance(task)
    dt = time.perf_counter() - t0
    if errors:
        console.print(f"[yellow]{len(errors)} creations failed, first: {errors[0]}")
        if not sbs:
            raise RuntimeError(f"every creation failed; first error: {errors[0]}")
    return dt, sbs


async def _stop_all(c: Client, sbs: list, progress: Progress, label: str) -> None:
    task = progress.add_task(label, total=len(sbs))
    sem = asyncio.Semaphore(8)

    async def stop(sb) -> None:
        async with sem:
            await sb.stop()
            progress.advance(task)
    await asyncio.gather(*(stop(sb) for sb in sbs))


async def _bench(n_create: int, n_idle: int, n_exec: int) -> dict:
    paths = Paths.from_env()
    images = ImageService(paths)
    rootfs = images.mount_image(IMAGE)
    if len(rootfs) != 1:
        raise RuntimeError("the raw-crun baseline needs a single-layer image")
    raw = RawCrun(rootfs[0])
    # Idle sandboxes (burst, density) get small limits; latency runs get a whole core, since a
    # 0.05-core CFS quota throttles even bash's start-up into the next 100 ms period.
    args = ContainerArgs(image=IMAGE, cpu_cores=0.05, memory_mb=64, ttl_idle_s=3600)
    busy = ContainerArgs(image=IMAGE, cpu_cores=1, memory_mb=512, ttl_idle_s=3600)
    out: dict = {}
    async with Client() as c:
        with Progress(console=console) as progress:
            try:
                # 1. creation throughput, same parallelism, same rootfs
                raw_s = await asyncio.to_thread(_raw_create, raw, n_create, "c")
                await asyncio.to_thread(raw.cleanup)
                sdk_s, sbs = await _sdk_create(c, n_create, args, progress, f"create {n_create} via SDK")
                out["create"] = {"n": n_create, "parallel": PARALLEL, "sdk_per_s": len(sbs) / sdk_s,
                                 "raw_per_s": n_create / raw_s}
                # 2. exec round trip of `true`
                sb = await c.create_container(busy)
                sbs.append(sb)
                lat = []
                for _ in range(n_exec):
                    t0 = time.perf_counter()
                    await sb.run("true")
                    lat.append((time.perf_counter() - t0) * 1000)
                await asyncio.to_thread(raw.run, "e0")
                raw_lat = []
                for _ in range(min(n_exec, 100)):
                    t0 = time.perf_counter()
                    await asyncio.to_thread(raw.exec_true, "e0")
                    raw_lat.append((time.perf_counter() - t0) * 1000)
                await asyncio.to_thread(raw.cleanup)
                out["exec"] = {"n": n_exec, "sdk_p50_ms": _pct(lat, 50), "sdk_p99_ms": _pct(lat, 99),
                               "raw_crun_exec_p50_ms": _pct(raw_lat, 50), "raw_crun_exec_p99_ms": _pct(raw_lat, 99)}
                # 3. time from create call to first output
                ttfo = []
                task = progress.add_task("time to first output", total=min(50, n_create))
                for _ in range(min(50, n_create)):
                    t0 = time.perf_counter()
                    s2 = await c.create_container(busy)
                    async for ev in s2.stream("echo ready"):
                        if ev.type == "stdout":
                            ttfo.append((time.perf_counter() - t0) * 1000)
                            break
                    await s2.stop()   # one whole core each: do not let them pile up against admission
                    progress.advance(task)
                out["ttfo"] = {"n": len(ttfo), "p50_ms": _pct(ttfo, 50), "p99_ms": _pct(ttfo, 99)}
                await _stop_all(c, sbs, progress, "stop")
                sbs = []

                # 4. host memory per idle sandbox
                base = await asyncio.to_thread(settled_mem_available_mib)
                _, sbs = await _sdk_create(c, n_idle, args, progress, f"create {n_idle} idle via SDK")
                after = await asyncio.to_thread(settled_mem_available_mib)
                sdk_mib = (base - after) / max(len(sbs), 1)
                await _stop_all(c, sbs, progress, "stop")
                sbs = []
                base = await asyncio.to_thread(settled_mem_available_mib)
                await asyncio.to_thread(_raw_create, raw, n_idle, "m")
                after = await asyncio.to_thread(settled_mem_available_mib)
                raw_mib = (base - after) / n_idle
                out["memory"] = {"n": n_idle, "sdk_mib_per_sandbox": sdk_mib, "raw_mib_per_container": raw_mib}
            finally:
                if sbs:
                    await _stop_all(c, sbs, progress, "stop")
                await asyncio.to_thread(raw.cleanup)
    return out


def run_core_bench(n_create: int, n_idle: int, n_exec: int, out: Path) -> dict:
    res = asyncio.run(_bench(n_create, n_idle, n_exec))
    cr, ex, tt, mem = res["create"], res["exec"], res["ttfo"], res["memory"]
    ratio = cr["sdk_per_s"] / cr["raw_per_s"]
    rows = [
        ("creations/s (SDK vs raw `crun run -d`)", f"{cr['sdk_per_s']:.1f}", f"{cr['raw_per_s']:.1f}",
         f"{ratio:.2f}", ">= 0.8"),
        ("exec `true` p50 ms (SDK vs `crun exec`)", f"{ex['sdk_p50_ms']:.2f}", f"{ex['raw_crun_exec_p50_ms']:.2f}",
         f"{ex['raw_crun_exec_p50_ms'] / ex['sdk_p50_ms']:.1f}x faster", "p50 <= 5 ms"),
        ("exec `true` p99 ms", f"{ex['sdk_p99_ms']:.2f}", f"{ex['raw_crun_exec_p99_ms']:.2f}", "", ""),
        (f"host MiB per idle sandbox at {mem['n']}", f"{mem['sdk_mib_per_sandbox']:.2f}",
         f"{mem['raw_mib_per_container']:.2f}", f"{mem['sdk_mib_per_sandbox'] / max(mem['raw_mib_per_container'], 1e-9):.2f}",
         "<= 1.5 MiB"),
        ("create call -> first output p50 / p99 ms", f"{tt['p50_ms']:.0f} / {tt['p99_ms']:.0f}", "", "", ""),
    ]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"\n## core — {when}\n",
          f"Command: `dsec bench core --n-create {n_create} --n-idle {n_idle} --n-exec {n_exec}` "
          f"on {os.cpu_count()} cores, kernel {platform.release()}, image `{IMAGE}`, {PARALLEL} creations in parallel "
          "for both sides; raw crun runs `sleep infinity` on the same EROFS rootfs (read-only, no overlay, no agent).\n",
          "| metric | dsec | raw crun | ratio | goal |", "|---|---|---|---|---|"]
    md += [f"| {' | '.join(r)} |" for r in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        out.write_text("# Benchmarks\n\nEach section is one run; every number is measured side by side with its baseline in that run.\n")
    with out.open("a") as f:
        f.write("\n".join(md) + "\n")
    console.print("\n".join(md))
    return res
