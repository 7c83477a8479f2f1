"""`dsec bench vm-density`: what an idle microVM clone costs the host, and how fast clones come,
with the memory settings toggled side by side in one run (issue 31).

Each configuration (a set of DSEC_VM_* settings, and the host's KSM daemon on or off) gets its
own isolated server (own DSEC_HOME, template built first and not timed), then:
  1. N clones of one template created with C in flight, each to its first `run("true")`: clones/s;
  2. held idle for `idle_s` (KSM: until its merge count stops growing, at most `ksm_wait_s`);
  3. MemAvailable lost per clone, and where each MiB goes, from every QEMU's smaps (guest RAM
     pages written since the restore, TCG code cache, QEMU's own anonymous memory, file pages,
     page tables), and the KSM savings the kernel counts;
  4. `run("true")` round trip on every clone with all alive (p50/p99);
  5. ksmd's CPU time over the idle phase.
Dozing configurations (idle clones' vCPUs stopped and their memory paged out to zram,
backends/vm/doze.py) wait in step 2 until every clone dozes, count what went to swap (each
QEMU's `Swap:` and the zram pool's growth) and run `true` twice per clone in step 4: the first
wakes it (and swaps in what it touches), the second is the steady state.
The host's KSM settings are put back as they were after each configuration.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

from dsec.bench.hostmem import mem_available_mib, settled_mem_available_mib
from dsec.bench.server import BenchServer
from dsec.procstat import TCK, cpu_ns, processes
from dsec.sdk.client import Client, Sandbox

console = Console()
KSM = Path("/sys/kernel/mm/ksm")
_PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


@dataclass(frozen=True)
class Config:
    name: str
    env: dict[str, str]
    ksmd: bool = False          # the host's ksmd runs during this configuration
    doze: bool = False          # idle clones doze (DSEC_VM_IDLE_STOP): wait for all of them


NO_DOZE = {"DSEC_VM_IDLE_STOP": "0"}       # columns that measure something else keep clones awake


CONFIGS = {
    # the code of another checkout (--baseline-src: e.g. the main branch before issue 31) with
    # its own defaults: today's clone path (qemu-img, `exec:cat`) and QEMU flags
    "baseline": Config("baseline checkout", {}),
    "before": Config("before (tb-size unset, no KSM)", {"DSEC_VM_TCG_TB_SIZE_MB": "0", "DSEC_VM_KSM": "0", **NO_DOZE}),
    "tb": Config("tb-size bounded, no KSM", {"DSEC_VM_KSM": "0", **NO_DOZE}),
    "ksm-ram": Config("tb-size bounded, KSM on guest RAM", {"DSEC_VM_KSM": "ram", **NO_DOZE}, ksmd=True),
    "ksm-all": Config("tb-size bounded, KSM on all of QEMU", {"DSEC_VM_KSM": "all", **NO_DOZE}, ksmd=True),
    # + idle clones doze (their idle threshold: --doze-idle-s, after KSM's first merges)
    "doze": Config("KSM all + idle clones doze, paged out", {"DSEC_VM_KSM": "all"}, ksmd=True, doze=True),
    "doze-stop": Config("KSM all + idle clones doze, not paged out",
                        {"DSEC_VM_KSM": "all", "DSEC_VM_IDLE_PAGEOUT": "0"}, ksmd=True, doze=True),
}


@dataclass
class Opts:
    n: int = 200
    inflight: int = 4
    idle_s: float = 20.0
    ksm_wait_s: float = 240.0
    memory_mb: int = 256
    image: str = "busybox"
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    tb_size_mb: int | None = None        # the bounded configurations' DSEC_VM_TCG_TB_SIZE_MB
    pages_to_scan: int = 2000
    min_mem_available_mib: float = 12 << 10
    idle_cpu_window_s: float = 20.0
    baseline_src: str | None = None      # PYTHONPATH of the "baseline" configuration's server
    kind: str = "microvm"                # or "vm" (q35 full VMs)
    doze_idle_s: float = 60.0            # DSEC_RECLAIM_IDLE_S of the dozing configurations
    doze_wait_s: float = 900.0           # longest wait for every clone to doze
    doze_per_tick: int = 4               # DSEC_RECLAIM_PER_TICK of the dozing configurations
    wakes_out: str | None = None         # a JSON file for every wake's (MiB in swap before, ms)

    def command(self) -> str:
        tb = f" --tb-size-mb {self.tb_size_mb}" if self.tb_size_mb is not None else ""
        return (f"dsec bench vm-density --n {self.n} --inflight {self.inflight} --idle-s {self.idle_s:g} "
                f"--ksm-wait-s {self.ksm_wait_s:g} --memory-mb {self.memory_mb} --image {self.image} "
                f"--pages-to-scan {self.pages_to_scan}{tb} --configs {','.join(self.configs)}"
                + (f" --kind {self.kind}" if self.kind != "microvm" else "")
                + (f" --doze-idle-s {self.doze_idle_s:g} --doze-per-tick {self.doze_per_tick}"
                   if any(CONFIGS[c].doze for c in self.configs) else "")
                + (" --baseline-src OLD/src" if self.baseline_src else ""))


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


# -- where the memory of one QEMU goes -----------------------------------------------------
PAGED_MIB = 4.0       # a dozing QEMU with this much in swap was paged out (D91), not only stopped


def vm_swap_mib(pidfile: Path) -> float:
    """VmSwap of the QEMU named by a pid file, MiB (0 when it cannot be read)."""
    try:
        pid = int(pidfile.read_text())
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmSwap:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def smaps_breakdown(pid: int, ram_mib: int) -> dict[str, float]:
    """KiB of one QEMU's memory by kind (guest RAM: its anonymous pages; the rest: private
    pages), plus KSM-merged KiB, PSS and page tables. Guest RAM is the mapping of the guest's size; the TCG code cache is the one
    anonymous executable mapping."""
    out = {"guest_ram": 0.0, "code_cache": 0.0, "qemu_anon": 0.0, "files": 0.0, "ksm": 0.0, "pss": 0.0,
           "swap": 0.0}
    kind, size = "qemu_anon", 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split(None, 5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                size, name, perm = (hi - lo) >> 10, (parts[5].strip() if len(parts) > 5 else ""), parts[1]
                if size == ram_mib << 10:
                    kind = "guest_ram"
                elif "x" in perm and not name:
                    kind = "code_cache"
                elif name.startswith("/") and not name.startswith("/dev/shm"):
                    kind = "files"
                else:
                    kind = "qemu_anon"
                continue
            key, _, rest = line.partition(":")
            # guest RAM: its anonymous pages (written since the restore; the rest is the
            # template's page cache, shared by every clone); elsewhere what no one else maps
            if (key == "Anonymous") if kind == "guest_ram" else key in ("Private_Dirty", "Private_Clean"):
                out[kind] += int(rest.split()[0])
            elif key == "KSM":
                out["ksm"] += int(rest.split()[0])
            elif key == "Swap":
                out["swap"] += int(rest.split()[0])
            elif key == "Pss":
                out["pss"] += int(rest.split()[0])
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmPTE:"):
                out["page_tables"] = float(line.split()[1])
    return out


# -- the host's KSM ----------------------------------------------------------------------
def ksm_read(name: str) -> int:
    return int((KSM / name).read_text().split()[0])


def ksm_set(values: dict[str, int]) -> dict[str, int]:
    """Write KSM knobs, returning the old values (to put back)."""
    old = {}
    for k, v in values.items():
        old[k] = ksm_read(k)
        (KSM / k).write_text(str(v))
    return old


def ksmd_cpu_s() -> float:
    """CPU seconds ksmd has used since boot (0 when there is no ksmd)."""
    for _, comm, _, ticks in processes():
        if comm == "ksmd":
            return ticks / TCK
    return 0.0


def ksm_saved_mib() -> float:
    """What merging saves host-wide right now: pages mapped from a merged copy, less the copies
    (pages_sharing), and zero pages mapped to the kernel's zero page."""
    zero = ksm_read("ksm_zero_pages") if (KSM / "ksm_zero_pages").exists() else 0
    return (ksm_read("pages_sharing") + zero) * _PAGE_KIB / 1024


def zram_used_mib() -> float:
    """Memory the host's zram devices use now (compressed pages and their metadata)."""
    total = 0
    for dev in Path("/sys/block").glob("zram*"):
        try:
            total += int((dev / "mm_stat").read_text().split()[2])
        except (OSError, ValueError, IndexError):
            continue
    return total / (1 << 20)


def dozed_ids(server: BenchServer) -> set[str]:
    """The sandboxes whose QEMU dozed (the driver logs each)."""
    out = set()
    for line in server.log_tail(10 ** 9).splitlines():
        if '"vm dozing"' in line:
            try:
                out.add(json.loads(line)["sandbox"])
            except (ValueError, KeyError):
                pass
    return out


CLONE_TTL_IDLE_S = 3600


# -- one configuration ---------------------------------------------------------------------
async def _one(c: Client, o: Opts) -> tuple[Sandbox, float]:
    t0 = time.perf_counter()
    # an hour's idle TTL: a slow 800 burst plus the KSM and doze waits outlast the default 600 s,
    # and the reaper would stop the first clones before they are measured
    if o.kind == "vm":
        sb = await c.create_vm(image=o.image, memory_mb=o.memory_mb, vcpus=1, ttl_idle_s=CLONE_TTL_IDLE_S)
    else:
        sb = await c.create_microvm(image=o.image, memory_mb=o.memory_mb, vcpus=1, ttl_idle_s=CLONE_TTL_IDLE_S)
    r = await sb.run("true")
    if r.exit_code != 0:
        raise RuntimeError(f"`true` failed in {sb.id}: {r}")
    return sb, time.perf_counter() - t0


async def _config(server: BenchServer, cfg: Config, o: Opts) -> dict:
    res: dict = {"config": cfg.name}
    sbs: list[Sandbox] = []
    async with server.client() as c:
        try:
            sb, first = await _one(c, o)          # builds the template: not timed below
            res["template_first_clone_s"] = first
            await sb.stop()
            base = await asyncio.to_thread(settled_mem_available_mib)
            zram0 = zram_used_mib()
            sem = asyncio.Semaphore(o.inflight)
            lat: list[float] = []

            refusals: list[str] = []

            async def go() -> None:
                async with sem:
                    try:
                        sb, s = await _one(c, o)
                    except Exception as e:      # a refusal (admission) or a failed clone: counted, named
                        refusals.append(f"{e.__class__.__name__}: {e}"[:300])
                        return
                    sbs.append(sb)
                    lat.append(s)
            t0 = time.perf_counter()
            await asyncio.gather(*(go() for _ in range(o.n)))
            res["refused"], res["refusals"] = len(refusals), sorted(set(refusals))[:5]
            if not sbs:
                raise RuntimeError(f"no clone was created: {refusals[:3]}")
            wall = time.perf_counter() - t0
            res.update(create_wall_s=wall, clones_per_s=len(sbs) / wall, create_p50_ms=_pct(lat, 50) * 1000,
                       create_p95_ms=_pct(lat, 95) * 1000)
            cpu0, t_idle = ksmd_cpu_s(), time.monotonic()
            await asyncio.sleep(o.idle_s)
            if cfg.ksmd:           # merging has settled: 2 full scans since the clones came
                # (a page merges on its 2nd look) and the saving stopped growing; a starved ksmd
                # on a busy box is slow, so the scans are counted, not the seconds
                scans0, last, deadline = ksm_read("full_scans"), -1.0, time.monotonic() + o.ksm_wait_s
                while time.monotonic() < deadline:
                    now = ksm_saved_mib()
                    if ksm_read("full_scans") - scans0 >= 2 and last >= 0 and now - last < max(1.0, 0.01 * now):
                        break
                    last = now
                    await asyncio.sleep(10)
                res["ksm_full_scans"] = ksm_read("full_scans") - scans0
            if cfg.doze:           # every clone dozed (the idle reclaim does a few per tick)
                want, deadline = {sb.id for sb in sbs}, time.monotonic() + o.doze_wait_s
                while not want <= (got := await asyncio.to_thread(dozed_ids, server)) and time.monotonic() < deadline:
                    await asyncio.sleep(5)
                res["dozed"] = len(want & got)
                await asyncio.sleep(5)       # the last pageouts' zram writes
            res["idle_s"] = time.monotonic() - t_idle
            res["ksmd_cpu_pct_idle"] = 100 * (ksmd_cpu_s() - cpu0) / res["idle_s"]
            cpu1, t1 = ksmd_cpu_s(), time.monotonic()
            after = await asyncio.to_thread(settled_mem_available_mib, 5)
            alive = len(sbs)
            res["zram_mib_per_vm"] = (zram_used_mib() - zram0) / alive
            res["ksmd_cpu_pct_steady"] = 100 * (ksmd_cpu_s() - cpu1) / (time.monotonic() - t1)
            res["memavail_per_vm_mib"] = (base - after) / alive
            res["ksm_saved_mib_per_vm"] = ksm_saved_mib() / alive if cfg.ksmd else 0.0
            parts: list[dict[str, float]] = []
            lost = []
            for sb in sbs:
                try:
                    pid = int((server.paths.vm_sandboxes / sb.id / "qemu.pid").read_text())
                    parts.append(smaps_breakdown(pid, o.memory_mb))
                except (OSError, ValueError):   # failed meanwhile (a saturated node misses pings)
                    lost.append(sb)
            res["lost"] = len(lost)
            sbs = [sb for sb in sbs if sb not in lost]
            res["per_vm_kib"] = {k: statistics.fmean(p.get(k, 0.0) for p in parts) for k in parts[0]}
            # idle CPU of every QEMU over one window (dozing ones: their main loop only)
            pids = []
            for sb in sbs:
                try:
                    pids.append(int((server.paths.vm_sandboxes / sb.id / "qemu.pid").read_text()))
                except (OSError, ValueError):
                    pass
            c0, t0 = sum(cpu_ns(p) for p in pids), time.monotonic()
            await asyncio.sleep(o.idle_cpu_window_s)
            res["idle_cpu_pct_per_vm"] = max(0.0, 100 * (sum(cpu_ns(p) for p in pids) - c0)
                                          / ((time.monotonic() - t0) * 1e9) / max(1, len(pids)))
            rtt, rtt2 = [], []
            wakes: list[tuple[float, float]] = []    # (its QEMU's VmSwap in MiB before, wake ms)
            for sb in sbs:
                try:
                    swap = vm_swap_mib(server.paths.vm_sandboxes / sb.id / "qemu.pid")
                    t = time.perf_counter()
                    await sb.run("true")        # a dozing clone: wakes, swaps in
                    rtt.append((time.perf_counter() - t) * 1000)
                    wakes.append((swap, rtt[-1]))
                    t = time.perf_counter()
                    await sb.run("true")        # awake
                    rtt2.append((time.perf_counter() - t) * 1000)
                except Exception:
                    res["lost"] += 1
                    continue
            # which wakes swapped in (paged out by the memory squeeze) and which only ran a
            # stopped QEMU again (D100's CPU squeeze): the two costs under one p50 (D102)
            paged = [ms for mib, ms in wakes if mib >= PAGED_MIB]
            stopped = [ms for mib, ms in wakes if mib < PAGED_MIB]
            res.update(exec_paged_n=len(paged), exec_paged_p50_ms=_pct(paged, 50) if paged else float("nan"),
                       exec_stopped_p50_ms=_pct(stopped, 50) if stopped else float("nan"))
            if o.wakes_out:
                Path(o.wakes_out).write_text(json.dumps(wakes))
            res.update(exec_p50_ms=_pct(rtt, 50), exec_p99_ms=_pct(rtt, 99),
                       exec2_p50_ms=_pct(rtt2, 50), exec2_p99_ms=_pct(rtt2, 99))
        finally:
            sem2 = asyncio.Semaphore(8)

            async def stop(sb: Sandbox) -> None:
                async with sem2:
                    await sb.stop()
            await asyncio.gather(*(stop(sb) for sb in sbs), return_exceptions=True)
    return res


def run_vm_density(o: Opts, out: Path | None) -> list[dict]:
    results = []
    load_before = os.getloadavg()[0]
    for key in o.configs:
        cfg = CONFIGS[key]
        avail = mem_available_mib()
        if avail < o.min_mem_available_mib:
            raise RuntimeError(f"MemAvailable {avail:.0f} MiB < {o.min_mem_available_mib:.0f} MiB: not running "
                               f"{o.n} clones on a shared box (--n smaller, or wait)")
        env = dict(cfg.env)
        if key == "baseline":
            if not o.baseline_src:
                raise RuntimeError("the baseline configuration needs --baseline-src (the src dir of the old checkout)")
            env["PYTHONPATH"] = o.baseline_src
        elif o.tb_size_mb is not None and "DSEC_VM_TCG_TB_SIZE_MB" not in env:
            env["DSEC_VM_TCG_TB_SIZE_MB"] = str(o.tb_size_mb)
        if cfg.doze:
            env["DSEC_RECLAIM_IDLE_S"] = env["DSEC_RECLAIM_PRESSED_IDLE_S"] = f"{o.doze_idle_s:g}"
            env["DSEC_RECLAIM_PER_TICK"] = str(o.doze_per_tick)
        server = BenchServer("dsec-bench-vmd-")
        server.env.update(env)
        old_ksm: dict[str, int] = {}
        try:
            server.prepare([o.image])
            server.start()
            if cfg.ksmd:
                old_ksm = ksm_set({"pages_to_scan": o.pages_to_scan, "run": 1})
            console.print(f"[bold]{cfg.name}[/]: {env}")
            r = asyncio.run(_config(server, cfg, o))
        finally:
            if old_ksm:
                ksm_set({"run": old_ksm["run"]})
                ksm_set({"pages_to_scan": old_ksm["pages_to_scan"]})
            leaked = server.close()
        if leaked:
            raise RuntimeError(f"QEMU processes outlived the bench (killed now): {leaked}")
        r["env"] = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        console.print(json.dumps(r))
        results.append(r)
    md = _report(results, o, load_before)
    console.print("\n".join(md))
    if out is not None:
        with out.open("a") as f:
            f.write("\n".join(md) + "\n")
    return results


def _report(rs: list[dict], o: Opts, load_before: float) -> list[str]:
    def mib(r: dict, k: str) -> str:
        return f"{r['per_vm_kib'].get(k, 0.0) / 1024:.1f}"
    rows = [
        ("clones/s, 4 in flight (create + first `true`)", lambda r: f"{r['clones_per_s']:.2f}"),
        ("create -> first `true` p50 / p95 ms", lambda r: f"{r['create_p50_ms']:.0f} / {r['create_p95_ms']:.0f}"),
        ("**MemAvailable lost per idle clone, MiB**", lambda r: f"**{r['memavail_per_vm_mib']:.1f}**"),
        ("PSS per clone, MiB", lambda r: mib(r, "pss")),
        ("  private: guest RAM written since the restore", lambda r: mib(r, "guest_ram")),
        ("  private: TCG code cache", lambda r: mib(r, "code_cache")),
        ("  private: QEMU's own anonymous memory (heap, TLBs, stacks)", lambda r: mib(r, "qemu_anon")),
        ("  private: file pages (relocations of QEMU and its libraries)", lambda r: mib(r, "files")),
        ("  page tables", lambda r: mib(r, "page_tables")),
        ("  in swap (QEMU's `Swap:`, uncompressed)", lambda r: mib(r, "swap")),
        ("zram pool growth per clone, MiB (compressed; in MemAvailable)", lambda r: f"{r.get('zram_mib_per_vm', 0.0):.1f}"),
        ("  KSM pages mapped (shared between clones, not in the private rows)", lambda r: mib(r, "ksm")),
        ("KSM saving host-wide per clone, MiB", lambda r: f"{r['ksm_saved_mib_per_vm']:.1f}"),
        ("ksmd CPU % of a core: while merging / steady", lambda r: f"{r['ksmd_cpu_pct_idle']:.0f} / "
                                                                   f"{r['ksmd_cpu_pct_steady']:.0f}"),
        ("idle CPU per clone, % of a core (all QEMU threads, one window)",
         lambda r: f"{r.get('idle_cpu_pct_per_vm', float('nan')):.3f}"),
        ("clones dozed", lambda r: str(r.get("dozed", "-"))),
        (f"`run(\"true\")` p50 / p99 ms, all {o.n} alive (a dozing clone: wakes it)",
         lambda r: f"{r['exec_p50_ms']:.1f} / {r['exec_p99_ms']:.1f}"),
        ("  of those: woken from swap (paged out): count, p50 ms / only stopped: p50 ms",
         lambda r: f"{r.get('exec_paged_n', 0)}, {r.get('exec_paged_p50_ms', float('nan')):.1f} / "
                   f"{r.get('exec_stopped_p50_ms', float('nan')):.1f}"),
        ("`run(\"true\")` again right after, p50 / p99 ms", lambda r: f"{r.get('exec2_p50_ms', float('nan')):.1f} / "
                                                                   f"{r.get('exec2_p99_ms', float('nan')):.1f}"),
        ("clones lost while idle (failed liveness pings)", lambda r: str(r.get("lost", 0))),
        ("creations refused or failed", lambda r: str(r.get("refused", 0))),
    ]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"\n## vm-density — {when}\n",
          f"Command: `{o.command()}` on {os.cpu_count()} cores, kernel {platform.release()}, TCG, image "
          f"`{o.image}`, {o.n} {'q35 VMs' if o.kind == 'vm' else 'clones'} of {o.memory_mb} MiB alive per configuration, each configuration its own "
          f"isolated server, one after the other in this run. MemAvailable lost = before the {o.n} creations "
          f"minus after the idle phase (median of 5 reads). Load average (1 min) before / after: "
          f"{load_before:.2f} / {os.getloadavg()[0]:.2f}.\n",
          "| metric | " + " | ".join(r["config"] for r in rs) + " |",
          "|---|" + "---|" * len(rs)]
    md += [f"| {label} | " + " | ".join(f(r) for r in rs) + " |" for label, f in rows]
    md += ["", "Settings per column: " + "; ".join(f"{r['config']}: `{' '.join(f'{k}={v}' for k, v in r['env'].items())}`"
                                                  for r in rs)]
    return md


# -- clone creation rate, old and new code interleaved ---------------------------------------
def _driver_ms(server: BenchServer) -> list[float]:
    """The driver's part of each creation ('vm started' events: overlay, QEMU launch, restore)."""
    out = []
    for line in server.log_tail(10 ** 8).splitlines():
        if '"vm started"' in line and '"clone"' in line:
            try:
                out.append(float(json.loads(line)["seconds"]) * 1000)
            except (ValueError, KeyError):
                pass
    return out


async def _rate_round(server: BenchServer, o: Opts, k: int) -> float:
    async with server.client() as c:
        sem = asyncio.Semaphore(o.inflight)
        sbs: list[Sandbox] = []

        async def go() -> None:
            async with sem:
                sbs.append((await _one(c, o))[0])
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(go() for _ in range(k)))
            return k / (time.perf_counter() - t0)
        finally:
            await asyncio.gather(*(sb.stop() for sb in sbs), return_exceptions=True)


def run_rate_ab(o: Opts, k: int, rounds: int, out: Path | None) -> dict:
    """Clones/s of the baseline checkout and of this one, in alternating rounds of k creations
    (create + first `true`, o.inflight in flight) so that both see the same neighbours."""
    if not o.baseline_src:
        raise RuntimeError("--rate-ab needs --baseline-src (the src dir of the old checkout)")
    servers = {"baseline": BenchServer("dsec-bench-vmr-"), "this": BenchServer("dsec-bench-vmr-")}
    servers["baseline"].env["PYTHONPATH"] = o.baseline_src
    rates: dict[str, list[float]] = {name: [] for name in servers}
    load_before = os.getloadavg()[0]
    try:
        for s in servers.values():
            s.prepare([o.image])
            s.start()
            asyncio.run(_rate_round(s, o, 1))        # the template build, not timed
        for i in range(rounds):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in order:
                rates[name].append(asyncio.run(_rate_round(servers[name], o, k)))
                console.print(f"round {i + 1} {name}: {rates[name][-1]:.2f} clones/s")
        drv = {name: _pct(_driver_ms(s)[1:], 50) for name, s in servers.items()}
    finally:
        leaked = [p for s in servers.values() for p in s.close()]
    if leaked:
        raise RuntimeError(f"QEMU processes outlived the bench (killed now): {leaked}")
    res = {name: {"median_clones_per_s": statistics.median(r), "rounds": r, "driver_p50_ms": drv[name]}
           for name, r in rates.items()}
    md = ["", f"Clone creation rate, old and new code in alternating rounds: `dsec bench vm-density --rate-ab "
          f"--rate-k {k} --rate-rounds {rounds} --inflight {o.inflight} --baseline-src OLD/src` ({k} clones of "
          f"{o.memory_mb} MiB per round, create + first `true`, then stopped; load average before / after "
          f"{load_before:.2f} / {os.getloadavg()[0]:.2f}).", "",
          "| code | clones/s, median of rounds | each round | driver's part (overlay, QEMU, restore) p50 ms |",
          "|---|---|---|---|"]
    md += [f"| {name} | {v['median_clones_per_s']:.2f} | {', '.join(f'{x:.2f}' for x in v['rounds'])} | "
           f"{v['driver_p50_ms']:.0f} |" for name, v in res.items()]
    console.print("\n".join(md))
    if out is not None:
        with out.open("a") as f:
            f.write("\n".join(md) + "\n")
    return res
