"""The dashboard's sandbox table at fleet size (issue 26 item 5: at 1366x768 with 3,200
sandboxes, at most 100 rows in the DOM, first paint <= 2 s).

An isolated `dsec up` (its own DSEC_HOME; PSI admission off, so that a busy shared box does
not stop the fleet short), N idle busybox sandboxes (0.1 core, 16 MiB), then R fresh loads of
/ui/#/sandboxes in a headless Chromium at 1366x768, logged in with the admin key. Each load
reports the browser's first contentful paint, when the table's rows were in the DOM (the
page's `dsec-rows` mark, after the first page of the server's answer was rendered), how long
the /v1/sandboxes call took, and how many rows the DOM holds.

    .venv/bin/python benchmarks/ui_first_paint.py --sandboxes 3200 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsec.testing import browser
from dsec.testing.isolated import ServerProcess, cleanup_home, link_node_downloads
from dsec.types import ContainerArgs

NO_PSI = {f"DSEC_ADMIT_PSI_{k}": "100" for k in ("CPU_SOME", "MEMORY_SOME", "MEMORY_FULL", "IO_FULL")}
PROBE = """
const paint = performance.getEntriesByName('first-contentful-paint')[0];
const rows = performance.getEntriesByName('dsec-rows')[0];
const list = performance.getEntriesByType('resource').filter(e => e.name.includes('/v1/sandboxes?'))[0];
return {fcp_ms: paint ? paint.startTime : null, rows_ms: rows ? rows.startTime : null,
        list_ms: list ? list.duration : null, rows: document.querySelectorAll('#rows tr').length,
        dom_tr: document.querySelectorAll('tr').length, count: document.getElementById('count').textContent};
"""


async def fleet(url: str, key: str, n: int) -> float:
    from dsec import Client
    t0 = time.monotonic()
    async with Client(url, key) as c:
        args = ContainerArgs(image="busybox", cpu_cores=0.1, memory_mb=16, ttl_idle_s=86400, labels={"bench": "ui"})
        done = 0
        async for r in c.create_many(n, args, concurrency=8):
            if not r.ok:
                raise SystemExit(f"creation {r.index} failed after {done}: {r.error}")
            done += 1
            if done % 250 == 0:
                print(f"  {done} sandboxes ({time.monotonic() - t0:.0f} s)", flush=True)
    return time.monotonic() - t0


def loads(url: str, key: str, rounds: int) -> list[dict]:
    d = browser.start()
    try:
        browser.login(d, url, key)
        out = []
        for _ in range(rounds):
            d.get("about:blank")
            d.get(f"{url}/ui/#/sandboxes")
            browser.wait_for(lambda: d.execute_script("return performance.getEntriesByName('dsec-rows').length"),
                             60, "the sandbox table")
            out.append(d.execute_script(PROBE))
        return out
    finally:
        browser.stop(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=3200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    o = ap.parse_args()
    if why := browser.missing():
        raise SystemExit(why)
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-ui-", dir="/var/tmp"))
    link_node_downloads(home)
    subprocess.run([sys.executable, "-m", "dsec", "image", "build", "busybox", "--builtin"],
                   env={**ServerProcess(home).env}, check=True, capture_output=True)
    srv = ServerProcess(home, {**NO_PSI, "DSEC_VM": "0"})
    srv.start(120)
    try:
        created_s = asyncio.run(fleet(srv.url, srv.key, o.sandboxes))
        got = loads(srv.url, srv.key, o.rounds)
    finally:
        srv.kill(15, timeout_s=600)
        cleanup_home(home)
    med = {k: statistics.median(g[k] for g in got if g[k] is not None) for k in ("fcp_ms", "rows_ms", "list_ms")}
    worst = {k: max(g[k] for g in got if g[k] is not None) for k in ("fcp_ms", "rows_ms", "list_ms")}
    report = {"sandboxes": o.sandboxes, "rounds": o.rounds, "created_s": round(created_s, 1), "loads": got,
              "median": med, "max": worst, "max_rows_in_dom": max(g["rows"] for g in got),
              "max_tr_in_dom": max(g["dom_tr"] for g in got)}
    print(json.dumps(report, indent=1))
    print(f"| {o.sandboxes} | {med['fcp_ms']:.0f} / {worst['fcp_ms']:.0f} | {med['rows_ms']:.0f} / {worst['rows_ms']:.0f} "
          f"| {med['list_ms']:.0f} / {worst['list_ms']:.0f} | {report['max_rows_in_dom']} |")
    if o.json:
        o.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
