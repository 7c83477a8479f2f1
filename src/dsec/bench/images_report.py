"""Markdown table and SVG plot for `dsec bench images --suite env` (no plotting dependency:
the SVG is written by hand)."""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from pathlib import Path


def _pct(a: float, b: float) -> str:
    return f"{100 * a / b:.1f}%"


def env_markdown(res: dict, command: str, svg_rel: str) -> str:
    eb = res["env_bytes"]
    out = [f"\n## images (env suite) — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n",
           f"Command: `{command}` on {_cores()} cores, kernel {platform.release()}. Store model for "
           f"every way: {res['latency_ms']:g} ms per request + one shared {res['bandwidth_mbps']:g} MB/s "
           f"link (lazy view: {res['chunk'] >> 10} KiB data chunks, 256 KiB metadata-pack segments; "
           "copies and tar.gz downloads: 4 MiB requests). Environment = base `bench-pyenv` (debootstrap "
           "bookworm + python3, numpy, scipy, pandas, sklearn, matplotlib, sympy, statsmodels, "
           f"gcc/g++, git; {res['base_bytes'] / 1e9:.2f} GB EROFS) + a workspace layer (a generated repo, "
           "12 MiB data) + a toolkit layer (`harness@1`, 24 MiB); each of the "
           f"{res['n_envs']} environments has its own workspace. Baselines get the equivalent full image: "
           f"per environment one monolithic EROFS of base+workspace+toolkit ({res['mono_bytes'] / 1e9:.2f} GB), "
           "or its tar.gz (gzip -6). Sandboxes are overlay mounts composed like the edge does "
           "(toolkit, workspace, base lowerdirs; upper on local disk) entered with chroot; "
           "every way starts on a cold node (fresh cache, page cache dropped).\n",
           "**Bytes fetched by one cold sandbox** (first command: `python3 -c 'import app'` in /work; "
           "workload: imports numpy/scipy/pandas/sklearn/matplotlib/sympy, fits a model, plots), "
           f"as a share of the environment's {eb / 1e9:.2f} GB:\n",
           "| lazy view | first command: fetched | % | s | after workload: fetched | % | s | metadata pack MB |",
           "|---|---|---|---|---|---|---|---|"]
    names = {"no-meta": "2 MiB chunks only (before)", "meta": "+ local metadata pack",
             "meta+profile": "+ access-profile bulk prefetch"}
    for f in res["fractions"]:
        out.append(f"| {names.get(f['way'], f['way'])} | {f['first_bytes'] / 1e6:.0f} MB | "
                   f"{_pct(f['first_bytes'], eb)} | {f['first_s']:.2f} | {f['work_bytes'] / 1e6:.0f} MB | "
                   f"{_pct(f['work_bytes'], eb)} | {f['work_s']:.2f} | {f['meta_bytes'] / 1e6:.1f} |")
    lazy = next(r for r in res["burst"] if r["way"] == "lazy")
    out += ["", f"**{res['n_sandboxes']} sandboxes of {res['n_envs']} environments** "
                f"(sandbox j uses environment j mod {res['n_envs']}; {res['parallel']} created at a time; "
                "ready = its first command finished; the tar.gz way runs "
                f"{res['tar_sample']} sandboxes for real and scales time and bytes linearly, since "
                "each unpack is independent work). Disk bytes written = write_bytes of the bench "
                "process, its children and the lazy-view daemon (/proc/PID/io):\n",
            "| way | all ready s | p50 ready s | fetched GB | written GB | lazy faster by | writes vs lazy |",
            "|---|---|---|---|---|---|---|"]
    for r in res["burst"]:
        out.append(f"| {r['way']} | {r['ready_all_s']:.1f} | {r['ready_p50_s']:.2f} | "
                   f"{r['fetched'] / 1e9:.2f} | {r['written'] / 1e9:.2f} | "
                   f"{r['ready_all_s'] / lazy['ready_all_s']:.1f}x | "
                   f"{r['written'] / max(lazy['written'], 1):.1f}x |")
    u = res["upgrade"]
    out += ["", f"**Upgrading the toolkit shared by {u['n']} workspaces** (harness@1 -> @2): layered = "
                "build one new toolkit layer (sandboxes name `toolkits=['harness@2']`); monolithic = "
                f"rebuild each image (base + workspace + new toolkit, mkfs.erofs + fsync); "
                f"{u['mono_sample']} rebuilt for real ({u['mono_s_each']:.1f} s each), scaled to {u['n']}:\n",
            "| way | seconds | bytes written | ratio |", "|---|---|---|---|",
            f"| layered: 1 toolkit layer | {u['layered_s']:.2f} | {u['layered_written'] / 1e6:.1f} MB | 1 |",
            f"| monolithic: {u['n']} images | {u['mono_s']:.0f} | {u['mono_written'] / 1e9:.1f} GB | "
            f"{u['mono_s'] / max(u['layered_s'], 1e-9):.0f}x time, "
            f"{u['mono_written'] / max(u['layered_written'], 1):.0f}x bytes |",
            "", f"![images bench]({svg_rel})", ""]
    return "\n".join(out)


def env_svg(res: dict, path: Path) -> None:
    """Two bar groups: time to ready for the burst, and fetched share for one sandbox."""
    bars1 = [(r["way"], r["ready_all_s"]) for r in res["burst"]]
    eb = res["env_bytes"]
    bars2 = []
    for f in res["fractions"]:
        bars2.append((f"{f['way']}: first", 100 * f["first_bytes"] / eb))
        bars2.append((f"{f['way']}: workload", 100 * f["work_bytes"] / eb))
    w, row, left = 900, 26, 300
    h = 80 + row * (len(bars1) + len(bars2)) + 60
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             'font-family="sans-serif" font-size="13">',
             f'<rect width="{w}" height="{h}" fill="white"/>']
    y = 30

    def group(title: str, bars: list[tuple[str, float]], unit: str, color: str) -> None:
        nonlocal y
        parts.append(f'<text x="10" y="{y}" font-weight="bold">{title}</text>')
        y += 12
        top = max(v for _, v in bars) or 1
        for label, v in bars:
            bw = (w - left - 90) * v / top
            parts.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end">{label}</text>')
            parts.append(f'<rect x="{left}" y="{y + 3}" width="{bw:.1f}" height="{row - 8}" fill="{color}"/>')
            parts.append(f'<text x="{left + bw + 5:.1f}" y="{y + 15}">{v:.1f} {unit}</text>')
            y += row
        y += 30

    group(f"Time until {res['n_sandboxes']} sandboxes of {res['n_envs']} environments are ready",
          bars1, "s", "#4477aa")
    group("Share of the environment fetched by one cold sandbox (lazy view)", bars2, "%", "#cc6677")
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def _cores() -> int:
    import os
    return os.cpu_count() or 0


def run_and_report_env(*, out: Path, work: Path, latency_ms: float, chunk_kb: int,
                       bandwidth_mbps: float, envs: int, sandboxes: int, parallel: int,
                       workspaces: int, mono_sample: int, tar_sample: int = 6) -> dict:
    """Run the env suite, print the summary, append table + plot link to `out`."""
    import json
    from dsec.bench.images import run_env_bench
    res = run_env_bench(work=work, n_envs=envs, n_sandboxes=sandboxes, parallel=parallel,
                        latency_ms=latency_ms, bandwidth_mbps=bandwidth_mbps, chunk=chunk_kb << 10,
                        n_workspaces=workspaces, mono_sample=mono_sample, tar_sample=tar_sample,
                        progress=lambda m: print(m, flush=True))
    command = (f"dsec bench images --suite env --latency-ms {latency_ms:g} --bandwidth-mbps "
               f"{bandwidth_mbps:g} --chunk-kb {chunk_kb} --envs {envs} --sandboxes {sandboxes} "
               f"--parallel {parallel} --workspaces {workspaces} --mono-sample {mono_sample} "
               f"--tar-sample {tar_sample}")
    svg = out.parent / "bench-images-env.svg"
    env_svg(res, svg)
    md = env_markdown(res, command, svg.name)
    with out.open("a") as f:
        f.write(md)
    (work / "last-env-result.json").write_text(json.dumps(res, indent=1, default=str))
    print(md, flush=True)
    return res
