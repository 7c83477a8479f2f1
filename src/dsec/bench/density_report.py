"""The summary of `dsec bench density`: rows with goals and verdicts, the Markdown recorded in
docs/benchmarks.md, the console table (the measurement is density.py's)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from rich.table import Table

from dsec.bench.density import (GOAL_BURST_X, GOAL_EXEC_P99_MS, GOAL_IDLE_MIB, GOAL_N, GOAL_PARKED_MIB, PRESSURE_WAIT_S, WINDOW, Opts,
                                console, measure)


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "**no**")


def _met_mem(x: float | None, goal: float) -> str:
    """A memory estimate below zero is the neighbours' noise, not a result: no verdict."""
    if x is None:
        return "n/a"
    return "n/a (below noise)" if x < 0 else _met(x <= goal)


def _met_parked(x: float | None, freed: float | None, idle: float) -> str:
    """Parking freed nothing measurable (MemAvailable fell meanwhile), or the idle cost it is
    taken from was below noise: no verdict either way."""
    if (freed is not None and freed < 0) or idle < 0:
        return "n/a (below noise)"
    return _met_mem(x, GOAL_PARKED_MIB)


Row = tuple[str, str, str, str, str, str, str]


def _row(metric: str, dsec: str, raw: str, ratio: str, goal: str, met: str, floor: str = "") -> Row:
    """A row in the table's column order; `floor` is the crun + dsec's containment column
    (filled for the burst only: floor.py)."""
    return (metric, dsec, floor, raw, ratio, goal, met)


def _floor_rows(burst: dict) -> list[Row]:
    """The cold burst's floor: what crun with dsec's containment alone takes, against raw crun
    (is the 1.3x goal within containment's reach?) and what dsec adds above it."""
    f, rw, d = burst.get("floor"), burst["raw"], burst["dsec"]
    if not f:
        return []
    fx = f["p50_ms"] / rw["p50_ms"] if f["p50_ms"] and rw["p50_ms"] else None
    above = d["p50_ms"] / f["p50_ms"] if d["p50_ms"] and f["p50_ms"] else None
    return [
        _row(f"burst of {burst['n']}: crun + dsec's containment alone (no server, no agent), p50 x raw", "",
             "1.00", _f(fx, ".2f"), f"p50 <= {GOAL_BURST_X:g}x raw (issue 29)",
             _met(None if fx is None else fx <= GOAL_BURST_X), _f(fx, ".2f")),
        _row(f"burst of {burst['n']}: dsec above its floor, p50 dsec / crun + containment", _f(above, ".2f"), "", "",
             "", ""),
        _row(f"burst of {burst['n']}: children's CPU ms per create (crun, nsexec, the container; not dsec's)", "",
             _f(rw.get("cpu_ms_per_create")), _f(f["cpu_ms_per_create"] / rw["cpu_ms_per_create"]
                                                 if rw.get("cpu_ms_per_create") else None, ".2f"),
             "", "", _f(f["cpu_ms_per_create"])),
    ]


def rows(res: dict) -> list[Row]:
    """(metric, dsec, crun + dsec's containment, raw crun, ratio, goal, met) rows of the summary."""
    raw, cr, idle, park, burst = res["raw"], res["create"], res["idle"], res["park"], res["burst"]
    out = []
    held = cr["created"]
    out.append(_row(f"idle sandboxes held (target {cr['target']})", f"{held}", "", "",
                f">= {GOAL_N:,} idle debian-python", _met(held >= GOAL_N)))
    w = cr["windows"]
    wtxt = ", ".join(_f(x["per_s"], ".0f") for x in w)
    out.append(_row(f"creations/s, whole fleet ({res['opts']['concurrency']} in flight)", _f(cr["per_s"]),
                _f(raw["create_per_s"]), _f(cr["per_s"] / raw["create_per_s"] if cr["per_s"] else None, ".2f"),
                "", ""))
    out.append(_row(f"creations/s per {WINDOW} (in order)", wtxt, "", "", "", ""))
    ex = idle["exec_true"]
    out.append(_row(f"`exec true` p50 / p99 ms, {ex['n']} random idle sandboxes at {held}",
                f"{_f(ex['p50_ms'])} / {_f(ex['p99_ms'])}", "", "", f"exec p99 <= {GOAL_EXEC_P99_MS:g} ms at that count",
                _met(ex["p99_ms"] <= GOAL_EXEC_P99_MS if ex["p99_ms"] is not None else None)))
    out.append(_row(f"host MiB per idle sandbox (MemAvailable; raw: {raw['n']} containers)",
                _f(idle["mib_per_sandbox"], ".2f"), _f(raw["mib_per_container"], ".2f"),
                _f(idle["mib_per_sandbox"] / raw["mib_per_container"]
                   if raw["mib_per_container"] > 0 and idle["mib_per_sandbox"] > 0 else None, ".2f"),
                f"idle <= {GOAL_IDLE_MIB:g} MiB", _met_mem(idle["mib_per_sandbox"], GOAL_IDLE_MIB)))
    out.append(_row("of which charged to the sandbox's memory cgroup (mean)", _f(idle["cgroup_charged_mib_mean"], ".2f"),
                _f(raw["cgroup_charged_mib_mean"], ".2f"), "", "", ""))
    out.append(_row("of which the server process's RSS growth", _f(idle.get("server_rss_mib_per_sandbox"), ".2f"),
                "", "", "", ""))
    if park.get("n"):
        out.append(_row(f"host MiB per parked sandbox ({park['n']} parked; idle minus freed)",
                    _f(park["mib_per_parked_sandbox"], ".2f"), "", "", f"parked <= {GOAL_PARKED_MIB:g} MiB",
                    _met_parked(park["mib_per_parked_sandbox"], park["freed_mib_per_parked"], idle["mib_per_sandbox"])))
        out.append(_row("MemAvailable freed per park, MiB", _f(park["freed_mib_per_parked"], ".2f"), "", "", "", ""))
        if "to_disk" in park:
            out.append(_row("of them parked to disk (quiescent, D44)", f"{park['to_disk']} of {park['n']}", "", "", "", ""))
        mem = park.get("in_memory")
        if mem:
            disk_mib, mem_mib = park["mib_per_parked_sandbox"], mem["mib_per_parked_sandbox"]
            out.append(_row(f"host MiB per parked sandbox, kept in memory by a background process ({mem['in_memory']} "
                        f"of {mem['n']} in memory; its sleep's {_f(mem['sleep_mib_per_sandbox'], '.2f')} MiB included)",
                        _f(mem_mib, ".2f"), "", _f(disk_mib / mem_mib if mem_mib and mem_mib > 0 else None, ".2f"),
                        "ratio: to disk / in memory", ""))
            ms, mr = mem["suspend"], mem["resume"]
            out.append(_row(f"in memory: suspend / resume p50 ms ({mem['n']})",
                        f"{_f(ms['p50_ms'])} / {_f(mr['p50_ms'])}", "", "", "", ""))
        s, r, e = park["suspend"], park["resume"], park["exec_after_resume"]
        out.append(_row(f"suspend p50 / p99 ms ({park['n']}, {res['opts']['concurrency']} in flight; wall s)",
                    f"{_f(s['p50_ms'])} / {_f(s['p99_ms'])} ({_f(s['wall_s'])} s)", "", "", "", ""))
        out.append(_row(f"resume p50 / p99 ms ({park['n']}; wall s)",
                    f"{_f(r['p50_ms'])} / {_f(r['p99_ms'])} ({_f(r['wall_s'])} s)", "", "", "", ""))
        out.append(_row(f"first `exec true` after resume p50 / p99 ms ({e['n']})",
                    f"{_f(e['p50_ms'])} / {_f(e['p99_ms'])}", "", "", "", ""))
        bulk = park.get("bulk", {})
        if bulk.get("available"):
            sa, ra = bulk.get("suspend_all", {}), bulk.get("resume_all", {})
            n = bulk["n"]
            out.append(_row(f"`suspend_all` by label of {n}: s (ms per sandbox)",
                        sa.get("error") or f"{_f(sa['s'], '.2f')} ({_f(1000 * sa['s'] / max(n, 1), '.1f')})",
                        "", "", "bulk pause of 1,000", ""))
            out.append(_row(f"`resume_all` by label of {n}: s (ms per sandbox)",
                        ra.get("error") or f"{_f(ra['s'], '.2f')} ({_f(1000 * ra['s'] / max(n, 1), '.1f')})",
                        "", "", "bulk resume of 1,000", ""))
            if "mib_per_parked_sandbox" in bulk:
                out.append(_row("host MiB per parked sandbox, parked by `suspend_all`",
                            _f(bulk["mib_per_parked_sandbox"], ".2f"), "", "", f"parked <= {GOAL_PARKED_MIB:g} MiB",
                            _met_parked(bulk["mib_per_parked_sandbox"], bulk["freed_mib_per_parked"],
                                        idle["mib_per_sandbox"])))
            e = bulk["exec_after_resume_all"]
            out.append(_row(f"first `exec true` after `resume_all` p50 / p99 ms ({e['n']})",
                        f"{_f(e['p50_ms'])} / {_f(e['p99_ms'])}", "", "", "", ""))
    d, rw = burst["dsec"], burst["raw"]
    bursts = [("", d)]
    if "pooled" in burst:
        p = burst["pooled"]
        bursts.append((f", from a warm pool of {burst['n']} ({_f(p['claimed'], 'd')} claimed)", p))
    f = burst.get("floor") or {}
    for label, b in bursts:
        # the floor's cells beside the cold burst only (the pooled one is the same raw burst)
        fp = f"{_f(f.get('p50_ms'), '.0f')} / {_f(f.get('p99_ms'), '.0f')}" if f and b is d else ""
        fw = _f(f.get("wall_s"), ".2f") if f and b is d else ""
        ratio = b["p50_ms"] / rw["p50_ms"] if b["p50_ms"] and rw["p50_ms"] else None
        out.append(_row(f"burst of {burst['n']}{label}: create -> first output p50 / p99 ms (raw: `crun run` -> output)",
                    f"{_f(b['p50_ms'], '.0f')} / {_f(b['p99_ms'], '.0f')}",
                    f"{_f(rw['p50_ms'], '.0f')} / {_f(rw['p99_ms'], '.0f')}", _f(ratio, ".2f"),
                    f"p50 <= {GOAL_BURST_X:g}x raw (issue 29)", _met(None if ratio is None else ratio <= GOAL_BURST_X),
                    fp))
        out.append(_row(f"burst of {burst['n']}{label}: wall s until the last output", _f(b["wall_s"], ".2f"),
                    _f(rw["wall_s"], ".2f"), _f(b["wall_s"] / rw["wall_s"] if rw["wall_s"] else None, ".2f"), "", "",
                    fw))
    out += _floor_rows(burst)
    td = res["teardown"]
    leaks = td["leaks"]
    nleak = sum(len(v) for v in leaks.values()) + len(res.get("live_left", []))
    out.append(_row(f"teardown: stops/s ({td['n']}); leftovers", f"{_f(td['per_s'])}; {nleak} left", "", "", "nothing left",
                _met(nleak == 0 and td["failed"] == 0)))
    return out


def markdown(res: dict, o: Opts) -> str:
    when = res.get("finished_utc") or datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    h, cr = res["host"], res["create"]
    md = [f"\n## density — {when}\n",
          f"Command: `{o.command_line()}` on {h['cores']} cores, {_f(h['mem_total_mib'] / 1024, '.1f')} GiB RAM, "
          f"{_f((h['swap_total_mib'] or 0) / 1024, '.1f')} GiB zram swap, kernel {h['kernel']}; isolated server "
          f"(own DSEC_HOME), image `{o.image}`, sandboxes of {o.cpu:g} cores / {o.memory_mb} MiB, "
          f"{o.concurrency} operations in flight. Raw crun baseline: `crun run -d` of `sleep infinity` on the same "
          f"EROFS rootfs (read-only, no overlay, no agent), same parallelism; burst baseline: foreground "
          f"`crun run` of `echo hi`. Host memory = MemAvailable lost (median of 5 reads a second apart after "
          f"{o.settle_s:g} s; no drop_caches, the box is shared). Load average (1 min) before the run: "
          f"{res['load1_before']:.2f}; run took {res['seconds']:.0f} s.\n",
          "Crun + dsec's containment: the same foreground `crun run` of `echo hi` with the container driver's "
          "config.json and nsexec (own user namespace, idmapped layers, overlay, masks, seccomp, lxcfs, limits, "
          "network namespace; bench/floor.py), no server, no agent.\n",
          "| metric | dsec | crun + dsec's containment | raw crun | ratio | goal (density issue) | met |",
          "|---|---|---|---|---|---|---|"]
    table = rows(res)
    md += [f"| {' | '.join(r)} |" for r in table]
    met = list(dict.fromkeys(r[5] for r in table if r[6] == "yes" and r[1]))
    missed = list(dict.fromkeys(r[5] for r in table if r[6] == "**no**" and r[1]))
    notes = [f"Goals of the density issue met in this run: {', '.join(met) or 'none'}; not met: "
             f"{', '.join(missed) or 'none'}."]
    if res["raw"]["mib_per_container"] < 0:
        notes.append("The raw-crun memory estimate came out below zero: a neighbour freed more than the "
                     "containers took while it was measured (no ratio).")
    if cr["refusal"]:
        notes.append(f"Creation stopped at {cr['created']}: `{cr['refusal']}`.")
    if cr["pressure_waits"]:
        pw = cr["pressure_waits"]
        at = ", ".join(x.split(":", 1)[0].removeprefix("at ") for x in pw)
        notes.append(f"{len(pw)} pressure refusals waited out ({PRESSURE_WAIT_S:g} s each, counted in the creation "
                     f"rates), at {at} sandboxes; the first verbatim: `{pw[0].split(': ', 1)[1]}`.")
    if cr["failed"]:
        notes.append(f"{cr['failed']} creations failed, first: `{cr['failures'][0]}`.")
    for k in ("suspend", "resume", "exec_after_resume"):
        v = res["park"].get(k)
        if v and v["failed"]:
            notes.append(f"{v['failed']} {k} failed, first: `{v['errors'][0]}`.")
    if res["idle"]["exec_failed"]:
        notes.append(f"{res['idle']['exec_failed']} idle `exec true` failed, first: `{res['idle']['exec_errors'][0]}`.")
    if res["burst"]["made_room_by_stopping"]:
        notes.append(f"The burst ran after stopping {res['burst']['made_room_by_stopping']} fleet sandboxes (the node "
                     "had refused more).")
    if not res["park"].get("bulk", {}).get("available", False):
        notes.append("The SDK has no bulk `suspend_all`/`resume_all` yet: pause/resume are per-sandbox calls.")
    md.append("\n" + " ".join(notes))
    return "\n".join(md) + "\n"


def print_summary(res: dict, o: Opts) -> None:
    t = Table("metric", "dsec", "crun + containment", "raw crun", "ratio", "goal", "met",
              title=f"density: {o.command_line()}")
    for r in rows(res):
        t.add_row(*(x.replace("**", "") for x in r))
    console.print(t)
    cr = res["create"]
    if cr["refusal"]:
        console.print(f"[yellow]creation stopped at {cr['created']}: {cr['refusal']}")


def record_from_json(json_path: Path, out: Path) -> str:
    """Append the summary of a run saved with --json (the numbers and date of that run)."""
    res = json.loads(json_path.read_text())
    o = Opts(**{k: v for k, v in res["opts"].items() if k != "n_park"})
    md = markdown(res, o)
    with out.open("a") as f:
        f.write(md)
    return md


def run_density_bench(o: Opts, out: Path | None, json_path: Path | None) -> dict:
    """Measure, print the summary, and append its Markdown to `out`."""
    res = measure(o, json_path)
    print_summary(res, o)
    if out is not None:
        md = markdown(res, o)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(md)
        console.print(f"appended to {out}")
    return res
