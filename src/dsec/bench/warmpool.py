"""`dsec bench warmpool`: create -> first output with and without a warm pool (edge/warm_pool.py,
D28), against raw `crun run` of the same rootfs, in one run on one isolated server.

For each mode the clock runs from the SDK's create call to the first stdout byte of
`stream("echo hi")` on the new sandbox (create, then the command's round trip):
  1. raw: B concurrent foreground `crun run` of `echo hi` on the image's EROFS rootfs (spawn ->
     first line on its stdout; bundles written before the clock starts), as `dsec bench density`.
  2. cold: B concurrent creates with no pool (every create starts a container).
  3. warm: the node's pool set to B (admin route), waited until full and the box settled, then B
     concurrent creates that claim from it.
  4. serial: S one-at-a-time creates, cold and warm (the pool refilled between), the latency
     without a burst's queueing.
  5. auto: the node's automatic pool (D99) on, bounded by the burst: burst 1 of the same shape
     (cold: the node learns it), then bursts 2 and 3 (from the pool it keeps on its own, waited
     full and settled between), beside a second raw burst run just before them.
The automatic pools are off (set through the admin route) for modes 2-4, so the cold rows stay
cold. Every sandbox is stopped; the pools are set back to none and the automatic bound to what
it was; the server and its home are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import os
import platform
import sys
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from dsec.bench.density import NoOutput, Raw, _err, _stats, create_echo, crun_burst
from dsec.bench.server import BenchServer
from dsec.bench.warm_fill import wait_full
from dsec.edge.warm_auto import MIN_BURST
from dsec.images.service import ImageService
from dsec.sdk.client import Client, Sandbox
from dsec.types import ContainerArgs, DsecError

console = Console(width=None if sys.stdout.isatty() else 160)
GOAL_P50_MS = 10.0


@dataclass
class Opts:
    burst: int = 50
    serial: int = 10
    image: str = "debian-python"
    settle_s: float = 5.0

    def command_line(self) -> str:
        return f"dsec bench warmpool --burst {self.burst} --serial {self.serial} --image {self.image}"


class WarmBench:
    def __init__(self, srv: BenchServer, c: Client, o: Opts):
        self.srv, self.c, self.o = srv, c, o
        # the run's own label: on a shared server (the tests' session server) other sandboxes
        # may be live; only this run's count as left behind
        self.labels = {"dsec-bench": "warmpool", "run": f"{os.getpid()}-{time.time_ns()}"}
        self.args = ContainerArgs(image=o.image, cpu_cores=1, memory_mb=256, ttl_idle_s=3600, labels=self.labels)

    # -- the pool, through the admin route -------------------------------------------------
    async def set_pool(self, size: int, timeout_s: float = 600) -> float:
        """Pool of `size`; waits until it holds them all. Returns the seconds the fill took."""
        t0 = time.perf_counter()
        await self.c.set_warm_pools(f"{self.o.image}:{size}" if size else "")
        if size == 0:
            return time.perf_counter() - t0
        waited, _ = await wait_full(self.c, self.o.image, size, timeout_s - (time.perf_counter() - t0),
                                    on_error=lambda e: console.print(f"[yellow]pool: {e}"))
        if waited is None:
            raise RuntimeError(f"the pool did not fill to {size} in {timeout_s:.0f} s")
        return time.perf_counter() - t0

    # -- one create -> first output ---------------------------------------------------------
    async def _one(self, out: list[float], create_ms: list[float], errs: list[str], made: list[Sandbox]) -> None:
        try:
            first_ms, call_ms = await create_echo(self.c, self.args, made.append)
            out.append(first_ms)
            create_ms.append(call_ms)
        except NoOutput as e:
            errs.append(str(e))
        except DsecError as e:
            errs.append(_err(e))
        except (httpx.HTTPError, OSError) as e:   # a dropped connection: counted, the run goes on
            errs.append(f"{type(e).__name__}: {e}")

    # -- the edge's own share of a create (its "sandbox created" log line, ms) ---------------
    def _log_size(self) -> int:
        try:
            return (self.srv.home / "server.log").stat().st_size
        except OSError:
            return 0

    def _edge_ms(self, since: int) -> dict[str, float | None]:
        """p50/p99 of the edge's create time (prepare .. running) logged since offset `since`."""
        ms: list[float] = []
        with open(self.srv.home / "server.log", "rb") as f:
            f.seek(since)
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("event") == "sandbox created" and "ms" in ev and ev.get("project") != "system":
                    ms.append(float(ev["ms"]))
        st = _stats(ms)
        return {"edge_create_p50_ms": st["p50_ms"], "edge_create_p99_ms": st["p99_ms"]}

    async def run_mode(self, n: int, concurrent: bool) -> dict:
        since = self._log_size()
        ttfo: list[float] = []
        create: list[float] = []
        errs: list[str] = []
        made: list[Sandbox] = []
        t0 = time.perf_counter()
        if concurrent:
            await asyncio.gather(*(self._one(ttfo, create, errs, made) for _ in range(n)))
        else:
            for _ in range(n):
                await self._one(ttfo, create, errs, made)
        wall = time.perf_counter() - t0
        await _stop_all(made)
        return {**_stats(ttfo), **{f"create_{k}": v for k, v in _stats(create).items() if k != "n"},
                "wall_s": wall, "failed": len(errs), "errors": errs[:5], **self._edge_ms(since)}

    async def auto_bursts(self, n: int) -> dict:
        """Bursts 1-3 of n with the node's automatic pool on (bounded by n): the first is cold
        and teaches the node the shape; before each later one the pool is waited full."""
        out: dict = {"auto_fill_s": []}
        await self.c.set_warm_pools("", auto=n)
        for i in (1, 2, 3):
            if i > 1:
                waited, err = await wait_full(self.c, self.o.image, n, 600, auto=True,
                                              on_error=lambda e: console.print(f"[yellow]auto pool: {e}"))
                if waited is None:
                    raise RuntimeError(f"the automatic pool did not fill to {n} in 600 s ({err})")
                out["auto_fill_s"].append(waited)
                await asyncio.sleep(self.o.settle_s)
            out[f"auto_burst{i}"] = await _claims_counted(self.c, self.run_mode(n, concurrent=True))
        return out

    async def serial_warm(self, n: int) -> dict:
        """One at a time, each from a full pool (refilled after each claim)."""
        since = self._log_size()
        ttfo: list[float] = []
        create: list[float] = []
        errs: list[str] = []
        for _ in range(n):
            await self.set_pool(1)
            await asyncio.sleep(0.5)
            made: list[Sandbox] = []
            await self._one(ttfo, create, errs, made)
            await _stop_all(made)
        return {**_stats(ttfo), **{f"create_{k}": v for k, v in _stats(create).items() if k != "n"},
                "failed": len(errs), "errors": errs[:5], **self._edge_ms(since)}

    async def raw_burst(self, n: int) -> dict:
        layers = ImageService(self.srv.paths).mount_image(self.o.image)
        if len(layers) != 1:
            raise RuntimeError(f"the raw-crun baseline needs a single-layer image; {self.o.image} has {len(layers)}")
        raw = Raw(layers[0], ["echo", "hi"])
        run_id = f"{os.getpid()}-{int(time.time())}"
        cids = [f"w{run_id}-{i}" for i in range(n)]
        res = await crun_burst(raw, cids)
        del res["ttfo_ms"]          # this bench reports the summary only
        return res


async def bench(srv: BenchServer, o: Opts) -> dict:
    res: dict = {"opts": asdict(o), "host": {"cores": os.cpu_count(), "kernel": platform.release()},
                 "load1_before": os.getloadavg()[0]}
    t0 = time.perf_counter()
    async with srv.client() as c:
        b = WarmBench(srv, c, o)
        auto_before = (await c.warm_pools()).auto_max
        await c.set_warm_pools(None, auto=0)      # the cold rows stay cold
        try:
            console.rule(f"raw: {o.burst} x crun run echo hi")
            res["raw_burst"] = await b.raw_burst(o.burst)
            console.rule(f"cold: {o.burst} concurrent creates, no pool")
            await asyncio.sleep(o.settle_s)
            res["cold_burst"] = await _claims_counted(c, b.run_mode(o.burst, concurrent=True))    # 0 claimed: cold
            console.rule(f"warm: pool of {o.burst}, then {o.burst} concurrent creates")
            res["pool_fill_s"] = await b.set_pool(o.burst)
            await asyncio.sleep(o.settle_s)
            res["warm_burst"] = await _claims_counted(c, b.run_mode(o.burst, concurrent=True))
            await b.set_pool(0)
            console.rule(f"serial: {o.serial} one-at-a-time creates, cold then warm")
            res["cold_serial"] = await _claims_counted(c, b.run_mode(o.serial, concurrent=False))
            res["warm_serial"] = await _claims_counted(c, b.serial_warm(o.serial))
            nb = max(o.burst, MIN_BURST)     # a smaller burst is no burst to the node
            console.rule(f"auto: raw again, then 3 bursts of {nb}, the node's automatic pool on")
            await b.set_pool(0)      # the serial pool's last refill is not left to overlap what follows
            await asyncio.sleep(o.settle_s)
            res["raw_burst_auto"] = await b.raw_burst(nb)
            await asyncio.sleep(o.settle_s)
            # the control: the same burst cold again here, automatic pools still off (a node that
            # has made and removed ~200 containers by now is slower than at the run's start)
            res["cold_burst_again"] = await b.run_mode(nb, concurrent=True)
            await asyncio.sleep(o.settle_s)
            res.update(await b.auto_bursts(nb))
        finally:
            await c.set_warm_pools("", auto=0)       # drains the automatic pool too
            await c.set_warm_pools(None, auto=auto_before)
            await b.set_pool(0)
            res["live_left"] = [s.id for s in await c.list() if s.labels.get("run") == b.labels["run"]]
    res["seconds"] = time.perf_counter() - t0
    res["finished_utc"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return res


async def _claims_counted(c: Client, mode: Awaitable[dict]) -> dict:
    """Run a mode (a coroutine not started yet); its result with `claimed`: the creates the
    node's pools answered meanwhile."""
    before = (await c.warm_pools()).claims
    m = await mode
    m["claimed"] = (await c.warm_pools()).claims - before
    return m


async def _stop_all(made: list[Sandbox]) -> None:
    """Stop them all; a stop that failed (a timeout on a loaded node: the server may still end it)
    is asked once more, stops being idempotent; what still fails shows in the run's live_left."""
    res = await asyncio.gather(*(sb.stop() for sb in made), return_exceptions=True)
    again = [sb for sb, r in zip(made, res) if isinstance(r, BaseException)]
    for sb, r in zip(again, await asyncio.gather(*(sb.stop() for sb in again), return_exceptions=True)):
        if isinstance(r, BaseException):
            console.print(f"[yellow]stop {sb.id}: {r.__class__.__name__}: {r}")


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}"


def rows(res: dict) -> list[tuple[str, str, str, str, str, str]]:
    """(mode, p50 / p99 ms create -> first output, create call p50 ms, the edge's part of it p50
    / p99 ms, x raw p50, x cold p50)."""
    raw, cold = res["raw_burst"]["p50_ms"], res["cold_burst"]["p50_ms"]
    out = [_raw_row(f"raw `crun run echo hi`, {res['opts']['burst']} at once", res["raw_burst"])]
    for key, label in (("cold_burst", "dsec, no pool, burst"), ("warm_burst", "dsec, warm pool, burst"),
                       ("cold_serial", "dsec, no pool, one at a time"), ("warm_serial", "dsec, warm pool, one at a time")):
        m = res[key]
        claimed = f" ({m['claimed']}/{m['n']} claimed)" if "claimed" in m else ""
        base = cold if "burst" in key else res["cold_serial"]["p50_ms"]
        out.append(_mode_row(label + claimed, m, raw, base))
    if "auto_burst1" in res:   # beside their own raw burst, run just before them
        raw2, first = res["raw_burst_auto"]["p50_ms"], res["auto_burst1"]["p50_ms"]
        out.append(_raw_row(f"raw `crun run echo hi`, {res['raw_burst_auto']['n']} at once (again, before the "
                            "automatic pool's bursts)", res["raw_burst_auto"]))
        out.append(_mode_row("dsec, no pool, burst (again here: the control)", res["cold_burst_again"], raw2, first))
        for i, what in ((1, "cold: the node learns the shape"), (2, "from the automatic pool"),
                        (3, "from the automatic pool")):
            m = res[f"auto_burst{i}"]
            out.append(_mode_row(f"dsec, automatic pool, burst {i} ({what}; {m['claimed']}/{m['n']} claimed)",
                                 m, raw2, first))
    return out


def _raw_row(label: str, m: dict) -> tuple[str, str, str, str, str, str]:
    return (label, f"{_f(m['p50_ms'])} / {_f(m['p99_ms'])}", "", "", "1.00", "")


def _mode_row(label: str, m: dict, raw: float | None, base: float | None) -> tuple[str, str, str, str, str, str]:
    """One dsec mode: its figures, x the raw burst and x its no-pool base."""
    return (label + (f", {m['failed']} failed" if m["failed"] else ""),
            f"{_f(m['p50_ms'])} / {_f(m['p99_ms'])}", _f(m.get("create_p50_ms")),
            f"{_f(m.get('edge_create_p50_ms'))} / {_f(m.get('edge_create_p99_ms'))}",
            _ratio(m["p50_ms"], raw), _ratio(m["p50_ms"], base))


def markdown(res: dict, o: Opts) -> str:
    lines = [f"### Warm pool: create -> first output ({res['finished_utc']})", "",
             f"`{o.command_line()}` on {res['host']['cores']} cores, kernel {res['host']['kernel']}, "
             f"load1 before {res['load1_before']:.2f} (a shared box). Pool of {o.burst} filled in "
             f"{res['pool_fill_s']:.1f} s. Goal: warm p50 <= {GOAL_P50_MS:g} ms under a burst.", "",
             *([("Automatic pool rows (D99, DSEC_WARM_POOL_AUTO set to the burst): x raw against the raw burst "
                 "run just before them, x no-pool against their burst 1 (cold, the node learns the shape); "
                 f"the pool filled in {', '.join(f'{x:.1f}' for x in res['auto_fill_s'])} s between bursts."), ""]
               if "auto_burst1" in res else []),
             "| mode | create -> first output p50 / p99 ms | create call (HTTP) p50 ms | edge's create p50 / p99 ms "
             "| x raw p50 | x no-pool p50 |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows(res)]
    return "\n".join(lines) + "\n"


def run_warmpool_bench(o: Opts, out: Path | None = None, json_out: Path | None = None) -> dict:
    srv = BenchServer("dsec-bench-warmpool-")
    srv.prepare([o.image])
    srv.start()
    try:
        res = asyncio.run(bench(srv, o))
    finally:
        if json_out:   # the server's log beside the results (the home goes with close())
            with contextlib.suppress(OSError):
                shutil.copy(srv.home / "server.log", json_out.with_suffix(".server.log"))
        srv.close()
    t = Table(title="create -> first output")
    for col in ("mode", "p50 / p99 ms", "create p50 ms", "edge create p50/p99", "x raw", "x no pool"):
        t.add_column(col)
    for r in rows(res):
        t.add_row(*r)
    console.print(t)
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))
    if out:
        with out.open("a") as f:
            f.write("\n" + markdown(res, o))
        console.print(f"appended to {out}")
    return res
