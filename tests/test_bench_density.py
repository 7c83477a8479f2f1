"""`dsec bench density` at tiny scale (5 sandboxes, 3 parked) against the session server: every
phase runs and reports, the numbers are sane, and nothing of the run is left behind. No timing
assertions: benchmarks are not timed unit tests."""

from __future__ import annotations

import math
import subprocess
import sys

from dsec.bench.density import Opts, bench
from dsec.bench.density_report import markdown, rows
from dsec.config import Paths


def test_help_lists_the_options() -> None:
    out = subprocess.run([sys.executable, "-m", "dsec", "bench", "density", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for opt in ("--n", "--image", "--cpu", "--memory-mb", "--park", "--concurrency", "--json", "--no-burst-pool"):
        assert opt in out


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


async def test_density_bench_tiny(server, client) -> None:
    o = Opts(n=5, park=3, concurrency=2, raw_n=3, burst=3, exec_sample=4, settle_s=0.5, mem_reads=1)
    res = await bench(client, Paths(server.home), o, server_pid=server.proc.pid)

    for phase in ("raw", "create", "idle", "park", "burst", "teardown"):
        assert phase in res, phase
    raw, cr, idle, park, burst, td = (res[k] for k in ("raw", "create", "idle", "park", "burst", "teardown"))

    assert raw["n"] == 3 and raw["create_per_s"] > 0 and _finite(raw["mib_per_container"])
    # the session server turns pressure admission off: nothing should refuse 5 small sandboxes
    assert cr["created"] == 5 and cr["refusal"] is None and cr["failed"] == 0, cr
    assert cr["windows"] and cr["windows"][0]["to"] == 5
    assert idle["n"] == 5 and _finite(idle["mib_per_sandbox"])
    assert idle["exec_true"]["n"] == 4 and idle["exec_failed"] == 0
    assert 0 < idle["exec_true"]["p50_ms"] <= idle["exec_true"]["p99_ms"]

    assert park["n"] == 3
    for k in ("suspend", "resume", "exec_after_resume"):
        assert park[k]["failed"] == 0 and park[k]["n"] >= 2, (k, park[k])
    assert _finite(park["mib_per_parked_sandbox"])
    assert park["to_disk"] == 3                        # quiescent: parked to disk (D44)
    mem = park["in_memory"]                            # ... and, for comparison, in memory
    assert mem["n"] == 3 and mem["in_memory"] == 3 and mem["suspend"]["failed"] == 0 and mem["resume"]["failed"] == 0
    assert mem["sleep_failed"] == 0 and _finite(mem["mib_per_parked_sandbox"])
    bulk = park["bulk"]
    if bulk["available"]:
        assert "error" not in bulk["suspend_all"] and bulk["suspend_all"]["items"] == 3, bulk
        assert "error" not in bulk["resume_all"] and bulk["resume_all"]["items"] == 3, bulk
        assert bulk["exec_after_resume_all"]["failed"] == 0

    assert burst["dsec"]["n"] == 3 and burst["dsec"]["failed"] == 0, burst["dsec"]
    assert burst["raw"]["n"] == 3 and burst["raw"]["failed"] == 0, burst["raw"]
    # crun + dsec's containment alone (D103): the driver's bundle replayed with `echo hi`, every part on
    floor = burst["floor"]
    assert floor["n"] == 3 and floor["failed"] == 0 and floor["variant"] == "full" and floor["off"] == [], floor
    assert floor["p50_ms"] > 0 and floor["cpu_ms_per_create"] > 0 and burst["raw"]["cpu_ms_per_create"] > 0
    assert floor["cgroups_left"] == []
    # the same burst from a warm pool of its size: every create answered by the pool (issue 29)
    pooled = burst["pooled"]
    assert pooled["n"] == 3 and pooled["failed"] == 0 and pooled["claimed"] == 3, pooled
    assert pooled["pool_fill_s"] is not None
    assert (await client.warm_pools()).pools == {}   # set back

    assert td["n"] == 5 and td["failed"] == 0
    assert td["leaks"] == {"crun_containers": [], "sandbox_cgroups": [], "raw_cgroups": []}
    assert res["live_left"] == []

    table = rows(res)
    assert all(len(r) == 7 for r in table)
    # the cold burst's row carries three columns: dsec, crun + dsec's containment, raw crun
    cold = next(r for r in table if r[0].startswith("burst of 3: create -> first output"))
    assert all(" / " in cell for cell in cold[1:4]), cold
    assert any(r[0].startswith("burst of 3: crun + dsec's containment alone") for r in table)
    md = markdown(res, o)
    assert "dsec bench density --n 5 --park 3" in md
    assert "from a warm pool of 3 (3 claimed)" in md and "p50 <= 1.3x raw" in md
    assert "| metric | dsec | crun + dsec's containment | raw crun |" in md
    assert all(line.count("|") == 8 for line in md.splitlines() if line.startswith("|"))
