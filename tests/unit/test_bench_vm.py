"""`dsec bench vm`: the command is wired and its report renders (the bench itself runs for
minutes under TCG, so it is not run here; benchmarks are not tests)."""

from __future__ import annotations

import subprocess
import sys

from dsec.bench.vm import Opts, _exec_rows, _md, _q35_rows, _rows


def _seq(p50: float) -> dict:
    return {"n": 1, "p50_ms": p50, "p95_ms": p50, "create_p50_ms": p50, "first_p50_ms": 1.0,
            "second_p50_ms": 1.0, "driver_p50_ms": 1.0, "wall_s": p50 / 1000}


def test_help_lists_the_options() -> None:
    out = subprocess.run([sys.executable, "-m", "dsec", "bench", "vm", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--n-idle" in out and "--image" in out


def test_report_renders_every_row() -> None:
    idle = {"pss_mean_mib": 50.0, "pss_sum_mib": 1000.0, "memavail_per_vm_mib": 40.0, "memavail_total_mib": 800.0}
    res = {"tpl": {"build_s": 3.0, "first_clone_ms": 3500.0}, "q35_tpl": {"build_s": 4.0, "first_clone_ms": 4500.0},
           "seq": {"clone": _seq(300), "cold": _seq(4000)}, "burst": {"clone": _seq(500), "cold": _seq(9000)},
           "q35_seq": {"clone": _seq(400), "cold": _seq(5000)},
           "idle": {"clone": idle, "cold": {**idle, "pss_mean_mib": 200.0, "memavail_per_vm_mib": 190.0}},
           "exec": {"microvm clone": {"p50_ms": 30.0, "p99_ms": 80.0}}}
    o = Opts()
    rows = _rows(res, o)
    assert any("13.3x faster" in r[3] for r in rows) and any(r[3] == "25%" for r in rows)
    md = _md(("a", "b", "c", "d", "e"), rows)
    assert all(line.count("|") == 6 for line in md)
    assert _exec_rows(res) == [("microvm clone", "30.0", "80.0")]
    assert len(_q35_rows(res, o)) == 4
    assert o.command().startswith("dsec bench vm --n 10 ")
