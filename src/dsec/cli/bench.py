"""`dsec bench ...`: benchmarks, side by side with baselines."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Optional

from rich.table import Table
import typer

from dsec.cli.common import _fail, console, err_console
from dsec.types import DsecError


bench_app = typer.Typer(no_args_is_help=True, help="benchmarks, side by side with baselines")

# -- benchmarks ------------------------------------------------------------------------------
@bench_app.command("core")
def bench_core(n_create: int = 200, n_idle: int = 500, n_exec: int = 300,
               out: Path = Path("docs/benchmarks.md")) -> None:
    """Creation rate vs raw crun, exec round trip, memory per idle sandbox, time to first output."""
    from dsec.bench.core import run_core_bench
    run_core_bench(n_create=n_create, n_idle=n_idle, n_exec=n_exec, out=out)


@bench_app.command("fork")
def bench_fork(n: Annotated[str, typer.Option(help="branch counts, comma separated")] = "8,32",
               files: Annotated[int, typer.Option(help="files the set-up writes (a repository)")] = 20000,
               setup_s: Annotated[float, typer.Option(help="seconds of CPU work the set-up adds")] = 20.0,
               replay_max: Annotated[int, typer.Option(help="run create + replay for N up to this")] = 32,
               note: Annotated[str, typer.Option(help="a sentence added to the report (e.g. the box's load)")] = "",
               rounds: Annotated[int, typer.Option(help="fork rounds per N (the median is reported)")] = 3,
               out: Path = Path("docs/benchmarks.md")) -> None:
    """Fork vs create + replay of a set-up: time to N ready, host bytes, host memory."""
    from dsec.bench.fork import run_fork_bench
    run_fork_bench([int(x) for x in n.split(",") if x], files, setup_s, replay_max, out, note, rounds)


@bench_app.command("fncall")
def bench_fncall(n_python: int = 3000, n_c: int = 300, n_sandbox: int = 30, n_latency: int = 200,
                 concurrency: int = 64, sandbox_parallel: int = 2,
                 out: Path = Path("docs/benchmarks.md")) -> None:
    """FnCall (warm pool) vs a container sandbox per call: calls/s and p50/p99, python and C."""
    from dsec.bench.fncall import run_fncall_bench
    run_fncall_bench(n_python=n_python, n_c=n_c, n_sandbox=n_sandbox, n_latency=n_latency,
                     concurrency=concurrency, sandbox_parallel=sandbox_parallel, out=out)


@bench_app.command("density")
def bench_density(
        n: Annotated[int, typer.Option(help="idle sandboxes to create (stops earlier at the first refusal)")] = 3200,
        image: str = "debian-python",
        cpu: Annotated[float, typer.Option(help="cpu_cores of each idle sandbox")] = 0.005,
        memory_mb: Annotated[int, typer.Option(help="memory_mb of each idle sandbox")] = 48,
        park: Annotated[Optional[int], typer.Option(help="sandboxes to park and resume [default: min(1000, n)]")] = None,
        concurrency: Annotated[int, typer.Option(help="creations/suspends/resumes/stops in flight (and raw crun "
                                                      "runs in parallel)")] = 8,
        raw_n: Annotated[int, typer.Option(help="raw crun containers of the baseline")] = 200,
        burst: Annotated[int, typer.Option(help="concurrent create -> first output, of each")] = 50,
        burst_pool: Annotated[bool, typer.Option(help="also the burst answered by a warm pool of its size, "
                                                      "beside the cold one")] = True,
        exec_sample: Annotated[int, typer.Option(help="sandboxes sampled for `exec true` latency")] = 200,
        pressure_retries: Annotated[int, typer.Option(help="PSI pressure refusals waited out (10 s each) before "
                                                           "the node counts as full")] = 0,
        json_path: Annotated[Optional[Path], typer.Option("--json", help="save the raw numbers here")] = None,
        record: Annotated[bool, typer.Option(help="append the summary to --out")] = True,
        out: Path = Path("docs/benchmarks.md")) -> None:
    """Most idle sandboxes the node holds, host memory per idle and parked sandbox, bulk park/resume,
    burst create -> first output; side by side with raw crun."""
    from dsec.bench.density import Opts
    from dsec.bench.density_report import run_density_bench
    run_density_bench(Opts(n=n, image=image, cpu=cpu, memory_mb=memory_mb, park=park, concurrency=concurrency,
                           raw_n=raw_n, burst=burst, burst_pool=burst_pool, exec_sample=exec_sample,
                           pressure_retries=pressure_retries),
                      out=out if record else None, json_path=json_path)


@bench_app.command("warmpool")
def bench_warmpool(
        burst: Annotated[int, typer.Option(help="concurrent creates per burst, and the pool's size")] = 50,
        serial: Annotated[int, typer.Option(help="one-at-a-time creates, cold and warm")] = 10,
        image: str = "debian-python",
        json_out: Annotated[Optional[Path], typer.Option("--json", help="write the raw results here")] = None,
        out: Annotated[Optional[Path], typer.Option(help="append the markdown table here")] = None) -> None:
    """Create -> first output with and without a warm pool, vs raw `crun run`, in one run."""
    from dsec.bench.warmpool import Opts as WarmOpts, run_warmpool_bench
    run_warmpool_bench(WarmOpts(burst=burst, serial=serial, image=image), out=out, json_out=json_out)


@bench_app.command("vm")
def bench_vm(n: Annotated[int, typer.Option(help="clones and cold boots, one at a time, of each")] = 10,
             burst: Annotated[int, typer.Option(help="VMs started in parallel, of each")] = 4,
             n_idle: Annotated[int, typer.Option(help="idle VMs alive at once, of each, for memory")] = 20,
             idle_s: float = 5.0, n_exec: int = 200,
             n_vm: Annotated[int, typer.Option(help="q35 clones and cold boots (0: skip q35)")] = 3,
             memory_mb: int = 256, vcpus: int = 1,
             image: Annotated[str, typer.Option(help="busybox or debian-python")] = "busybox",
             out: Path = Path("docs/benchmarks.md")) -> None:
    """microVM clone-from-snapshot vs cold boot: time to first command, PSS per idle VM, exec round trip."""
    from dsec.bench.vm import Opts, run_vm_bench
    run_vm_bench(Opts(n=n, burst=burst, n_idle=n_idle, idle_s=idle_s, n_exec=n_exec, n_vm=n_vm,
                      memory_mb=memory_mb, vcpus=vcpus, image=image), out=out)


@bench_app.command("vm-density")
def bench_vm_density(
        n: Annotated[int, typer.Option(help="idle clones alive at once, per configuration")] = 200,
        inflight: Annotated[int, typer.Option(help="creations in flight")] = 4,
        idle_s: float = 20.0,
        ksm_wait_s: Annotated[float, typer.Option(help="longest wait for KSM merging to settle")] = 240.0,
        memory_mb: int = 256, image: str = "busybox",
        configs: Annotated[str, typer.Option(help="comma-separated: baseline, before, tb, ksm-ram, ksm-all, doze, doze-stop")]
        = "before,tb,ksm-ram,ksm-all",
        tb_size_mb: Annotated[Optional[int], typer.Option(help="DSEC_VM_TCG_TB_SIZE_MB of the bounded ones "
                                                                "(default: the setting's)")] = None,
        pages_to_scan: Annotated[int, typer.Option(help="ksmd pages_to_scan while a KSM configuration runs")] = 2000,
        baseline_src: Annotated[Optional[str], typer.Option(help="src dir of an older checkout for `baseline`")] = None,
        min_available_gib: Annotated[float, typer.Option(help="refuse to start below this MemAvailable")] = 12.0,
        rate_ab: Annotated[bool, typer.Option(help="instead: clones/s of --baseline-src and this code, "
                                                   "alternating rounds")] = False,
        rate_k: int = 40, rate_rounds: int = 4,
        idle_ab: Annotated[Optional[str], typer.Option(help="instead: idle CPU per clone of two sides at once, "
                                                            "e.g. baseline,this; ksm-all,ksm-ram; this,DSEC_VM_TCG_TB_SIZE_MB=16")] = None,
        idle_k: Annotated[int, typer.Option(help="idle clones per side (--idle-ab)")] = 20,
        idle_windows: int = 6, idle_window_s: float = 20.0,
        kind: Annotated[str, typer.Option(help="microvm (clones) or vm (q35 full VMs)")] = "microvm",
        doze_idle_s: Annotated[float, typer.Option(help="DSEC_RECLAIM_IDLE_S of the doze configurations")] = 60.0,
        doze_per_tick: Annotated[int, typer.Option(help="DSEC_RECLAIM_PER_TICK of the doze configurations")] = 4,
        burst: Annotated[int, typer.Option(help="instead: this many clones created at once and kept alive, "
                                                 "then stopped together")] = 0,
        burst_floor_gib: Annotated[float, typer.Option(help="--burst stops creating below this MemAvailable")] = 3.0,
        wakes_out: Annotated[Optional[str], typer.Option(help="write every wake of the sweep as JSON "
                                                              "[MiB in swap before, ms] to this file")] = None,
        out: Optional[Path] = Path("docs/benchmarks.md")) -> None:
    """What an idle microVM clone costs the host and how fast clones come, per memory setting,
    side by side (toggles the host's ksmd for the KSM columns and puts it back)."""
    from dsec.bench.vmdensity import Opts as DensityOpts, run_rate_ab, run_vm_density
    if idle_ab:
        from dsec.bench.vmidle import run_idle_ab
        run_idle_ab(DensityOpts(inflight=inflight, memory_mb=memory_mb, image=image, baseline_src=baseline_src,
                                pages_to_scan=pages_to_scan), idle_ab.split(","), idle_k, idle_windows,
                    idle_window_s, out)
        return
    if burst:
        from dsec.bench.vmburst import run_burst
        run_burst(DensityOpts(inflight=inflight, memory_mb=memory_mb, image=image), burst, burst_floor_gib * 1024, out)
        return
    if rate_ab:
        run_rate_ab(DensityOpts(inflight=inflight, memory_mb=memory_mb, image=image, baseline_src=baseline_src),
                    rate_k, rate_rounds, out)
        return
    run_vm_density(DensityOpts(n=n, inflight=inflight, idle_s=idle_s, ksm_wait_s=ksm_wait_s, memory_mb=memory_mb,
                               image=image, configs=configs.split(","), tb_size_mb=tb_size_mb,
                               pages_to_scan=pages_to_scan, baseline_src=baseline_src,
                               min_mem_available_mib=min_available_gib * 1024, kind=kind,
                               doze_idle_s=doze_idle_s, doze_per_tick=doze_per_tick, wakes_out=wakes_out), out=out)


@bench_app.command("qos")
def bench_qos(steps: Annotated[int, typer.Option(help="agent steps per mode per round")] = 25,
              rounds: Annotated[int, typer.Option(help="rounds of alone / unprotected / protected, interleaved")] = 20,
              step_ms: Annotated[float, typer.Option(help="CPU work of one step alone (calibrated)")] = 20.0,
              gap_ms: Annotated[float, typer.Option(help="sleep before each step")] = 10.0,
              busy_ms: Annotated[float, typer.Option(help="load worker: CPU time per cycle")] = 10.0,
              idle_ms: Annotated[float, typer.Option(help="load worker: sleep per cycle")] = 10.0,
              load_sandboxes: Annotated[int, typer.Option(help="load sandboxes per class (0: one per core)")] = 0,
              out: Path = Path("docs/benchmarks.md")) -> None:
    """CPU QoS classes: a latency sandbox's step latency alone, beside 50% load of the same class, beside batch load."""
    from dsec.bench.qos import Opts, run_qos_bench
    run_qos_bench(Opts(steps=steps, rounds=rounds, step_ms=step_ms, gap_ms=gap_ms, busy_ms=busy_ms,
                       idle_ms=idle_ms, load_sandboxes=load_sandboxes), out=out)


@bench_app.command("cluster")
def bench_cluster(n: Annotated[int, typer.Option(help="sandboxes created per round, per arm")] = 60,
                  concurrency: Annotated[int, typer.Option(help="creates in flight at once")] = 8,
                  rounds: int = 2) -> None:
    """Creations/s through 2 apiserver replicas and 3 edges (a local Ray cluster) vs one embedded server."""
    from dsec.cluster.bench import main as bench_main
    bench_main(n, concurrency, rounds)


@bench_app.command("cluster-sim")
def bench_cluster_sim(
        nodes: int = 160, live: Annotated[int, typer.Option(help="live sandboxes at start (and kept near)")] = 380_000,
        rate: Annotated[float, typer.Option(help="creations per second of simulated time")] = 5000.0,
        duration: Annotated[float, typer.Option(help="simulated seconds per policy")] = 30.0,
        poll: Annotated[float, typer.Option(help="watcher poll interval, simulated seconds")] = 1.0,
        images: int = 2000, cache_images: Annotated[int, typer.Option(help="images each node keeps")] = 32,
        hot_share: Annotated[float, typer.Option(help="share of creations for one new image")] = 0.2,
        hot_nodes: Annotated[int, typer.Option(help="nodes that hold the new image at the start")] = 2,
        fail_every: Annotated[float, typer.Option(help="a node dies every this many seconds")] = 10.0,
        down: Annotated[float, typer.Option(help="seconds a dead node stays down")] = 15.0,
        seed: int = 1,
        policies: Annotated[str, typer.Option(help="comma-separated: random, p2-stale, p2, p3, p2+loc, "
                                                   "p2+loc0.2, p2+local-first")]
        = "random,p2-stale,p2,p2+loc,p2+local-first",
        out: Annotated[Optional[Path], typer.Option(help="append the markdown report to this file")] = None) -> None:
    """The real placer and watcher over simulated edges: decision latency, imbalance, rejects, locality (D34)."""
    from dsec.bench.cluster_sim import Opts, report, run
    o = Opts(nodes=nodes, live=live, rate=rate, duration_s=duration, poll_s=poll, images=images,
             cache_images=cache_images, hot_share=hot_share, hot_nodes=hot_nodes, fail_every_s=fail_every,
             down_s=down, seed=seed,
             policies=tuple(p.strip() for p in policies.split(",") if p.strip()))
    try:
        text = report(o, run(o))
    except DsecError as e:
        _fail(e)
    print(text)
    if out is not None:
        with out.open("a") as f:
            f.write(f"\n## cluster-sim — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n\n{text}\n")


@bench_app.command("images")
def bench_images(image: str = "debian-python", latency_ms: float = 5.0, chunk_mb: int = 2,
                 out: Path = Path("docs/benchmarks.md"),
                 suite: Annotated[str, typer.Option(help="'small': one image, three ways; 'env': the "
                                                         ">= 1 GB environment suite (issue 3)")] = "small",
                 chunk_kb: Annotated[int, typer.Option(help="env suite: lazy data chunk size")] = 2048,
                 bandwidth_mbps: Annotated[float, typer.Option(help="env suite: store bandwidth")] = 100.0,
                 envs: int = 10, sandboxes: int = 50, parallel: int = 2, workspaces: int = 100,
                 mono_sample: Annotated[int, typer.Option(help="env suite: monolithic rebuilds done "
                                                              "for real (scaled to --workspaces)")] = 3,
                 tar_sample: Annotated[int, typer.Option(help="env suite: tar.gz sandboxes run for "
                                                             "real (scaled to --sandboxes)")] = 6,
                 work: Annotated[Path, typer.Option(help="env suite: cache of the built environments")]
                 = Path("/var/cache/dsec-bench")) -> None:
    """Lazy (FUSE, on-demand chunks) vs full copy vs tar.gz unpack: bytes fetched, time to ready."""
    if suite == "env":
        from dsec.bench.images_report import run_and_report_env
        run_and_report_env(out=out, work=work, latency_ms=latency_ms, chunk_kb=chunk_kb,
                           bandwidth_mbps=bandwidth_mbps, envs=envs, sandboxes=sandboxes,
                           parallel=parallel, workspaces=workspaces, mono_sample=mono_sample,
                           tar_sample=tar_sample)
        return
    if suite != "small":
        err_console.print("[red]error[/red]: --suite must be 'small' or 'env'")
        raise typer.Exit(2)
    from dsec.bench.images import run_images_bench
    rows = run_images_bench(image=image, latency_ms=latency_ms, chunk=chunk_mb << 20)
    t = Table("way", "image MB", "fetched MB", "fetched %", "ready s",
              title=f"{image}, {latency_ms:g} ms per {chunk_mb} MiB request")
    md = [f"\n## images — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n",
          f"Command: `dsec bench images --image {image} --latency-ms {latency_ms:g} --chunk-mb {chunk_mb}`: "
          "one image, started cold each way (`/bin/sh -c true` in a chroot of it), store with injected "
          "per-request latency; ratios are against the full copy in the same run.\n",
          "| way | image MB | fetched MB | fetched % | ready s | ready vs full copy |", "|---|---|---|---|---|---|"]
    full = next((r for r in rows if r["way"].startswith("full")), rows[0])
    for r in rows:
        cells = (r["way"], f"{r['image_bytes'] / 1e6:.1f}", f"{r['bytes_fetched'] / 1e6:.1f}",
                 f"{100 * r['bytes_fetched'] / r['image_bytes']:.1f}", f"{r['ready_s']:.2f}")
        t.add_row(*cells)
        md.append(f"| {' | '.join(cells)} | {r['ready_s'] / max(full['ready_s'], 1e-9):.2f} |")
    console.print(t)
    with out.open("a") as f:
        f.write("\n".join(md) + "\n")
