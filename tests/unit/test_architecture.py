"""The import graph keeps the architecture: no cycles, concrete backends only in the
composition root, the edge free of FnCall/apiserver, the SDK free of the server side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_architecture.py"


def test_import_graph_has_no_violations() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "architecture: 0 violation(s)" in r.stdout


def test_the_checker_finds_cycles() -> None:
    """The checker itself works: a three-module cycle is found, a module hanging off it is not in it."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import check_architecture as ca
    finally:
        sys.path.pop(0)
    cycles = ca.strongly_connected({"a", "b", "c", "d"}, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycles == [["a", "b", "c"]]
    assert ca.subpackage("dsec.backends.vm.driver") == "dsec.backends.vm"
    assert ca.subpackage("dsec.edge.edge") == "dsec.edge"
