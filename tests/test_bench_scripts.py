"""The scripts under benchmarks/ that drive isolated servers: importing one runs nothing, and
a bad argument is refused before any server home is made (benchmarks/burst_ab.py used to run
at import and to leave an empty /var/tmp/dsec-burst-ab-* behind for an unknown variant)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'benchmarks'}"}


def test_importing_burst_ab_runs_nothing() -> None:
    r = subprocess.run([sys.executable, "-c", "import burst_ab; print(burst_ab.env_of('slots=2+pool', 5))"],
                       check=False, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("{'DSEC_WARM_POOL_AUTO': '0', 'DSEC_CREATE_PARALLEL': '2', "
                                "'DSEC_WARM_POOL': 'debian-python:5'}")


def test_burst_ab_refuses_a_bad_variant_before_making_a_home() -> None:
    # a private /var/tmp (a tmpfs in a mount namespace of its own): other runs' homes are not seen
    script = 'mount -t tmpfs dsec-test /var/tmp && "$0" benchmarks/burst_ab.py 1 bogus; echo "rc=$?"; ls -A /var/tmp'
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable],
                       cwd=ROOT, check=False, env=ENV, capture_output=True, text=True, timeout=120)
    assert "unknown variant part 'bogus'" in r.stderr, r.stderr
    assert r.stdout.split() == ["rc=1"], r.stdout       # and nothing left in /var/tmp


def test_burst_floor_imports_quietly_and_refuses_a_bad_variant_before_making_a_home() -> None:
    r = subprocess.run([sys.executable, "-c", "import burst_floor; print(burst_floor.IMAGE)"],
                       check=False, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "debian-python", r.stderr
    script = 'mount -t tmpfs dsec-test /var/tmp && "$0" benchmarks/burst_floor.py 1 2 no-bogus; echo "rc=$?"; ls -A /var/tmp'
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable],
                       cwd=ROOT, check=False, env=ENV, capture_output=True, text=True, timeout=120)
    assert "unknown variant 'no-bogus'" in r.stderr, r.stderr
    assert r.stdout.split() == ["rc=1"], r.stdout
