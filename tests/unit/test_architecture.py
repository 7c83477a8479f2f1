"""The import graph keeps the architecture: no cycles, concrete backends only in the
composition root, the edge free of FnCall/apiserver, the SDK free of the server side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_architecture.py"


def test_import_graph_has_no_violations() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "architecture: 0 violation(s)" in r.stdout


def _checker():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import check_architecture as ca
    finally:
        sys.path.pop(0)
    return ca


def test_the_checker_finds_cycles() -> None:
    """The checker itself works: a three-module cycle is found, a module hanging off it is not in it."""
    ca = _checker()
    cycles = ca.strongly_connected({"a", "b", "c", "d"}, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycles == [["a", "b", "c"]]
    assert ca.subpackage("dsec.backends.vm.driver") == "dsec.backends.vm"
    assert ca.subpackage("dsec.edge.edge") == "dsec.edge"


def test_the_checker_names_modules_it_cannot_see(tmp_path: Path, monkeypatch) -> None:
    """A directory without __init__.py hides its modules (and their cycle) from grimp, as
    backends/vm's did: the checker names them; with the __init__.py, it sees the cycle."""
    ca = _checker()
    pkg = tmp_path / "archpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from archpkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from archpkg.sub import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    on_disk = ca.modules_on_disk("archpkg")
    assert on_disk == {"archpkg", "archpkg.sub.a", "archpkg.sub.b"}
    graph = grimp.build_graph("archpkg", cache_dir=None)
    assert ca.unseen(set(graph.modules), on_disk) == [
        f"module not in the import graph (a package without __init__.py?): archpkg.sub.{m}" for m in "ab"]
    (pkg / "sub" / "__init__.py").write_text("")
    graph = grimp.build_graph("archpkg", cache_dir=None)
    modules = set(graph.modules)
    assert ca.unseen(modules, ca.modules_on_disk("archpkg")) == []
    edges = {m: set(graph.find_modules_directly_imported_by(m)) & modules for m in modules}
    assert ca.strongly_connected(modules, edges) == [["archpkg.sub.a", "archpkg.sub.b"]]
