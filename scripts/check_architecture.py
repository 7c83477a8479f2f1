"""Architecture checks on the import graph of `dsec` (run in CI by tests/unit/test_architecture.py).

Prints every violation and exits 1 if there is any:
- a module on disk the graph does not have (a directory without `__init__.py` hides its
  modules from grimp, and with them their imports: backends/vm's one cycle went unseen so);
- import cycles between modules and between subpackages (every import counts: module level,
  inside functions, and under TYPE_CHECKING, since each is a dependency a reader must follow);
- concrete backends (dsec.backends.container, dsec.backends.vm) imported outside themselves
  and the places that compose or operate a node (the composition root, CLI, benchmarks, tests);
- the edge importing FnCall, the apiserver or the composition root; the SDK importing
  anything of the server side.
Built on grimp (the graph library under import-linter).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import grimp

CONCRETE_BACKENDS = ("dsec.backends.container", "dsec.backends.vm")
MAY_COMPOSE = ("dsec.embedded", "dsec.cli", "dsec.bench", "dsec.testing")
EDGE_MUST_NOT = ("dsec.fncall", "dsec.apiserver", "dsec.embedded", "dsec.sdk", "dsec.cli", *CONCRETE_BACKENDS)
# dsec.tracing: the spans and traceparent shared by the SDK and the server (it imports only
# dsec.types; OpenTelemetry lazily, when the program turned traces on)
SDK_MAY = ("dsec.sdk", "dsec.types", "dsec.config", "dsec.tracing")


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def strongly_connected(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the cycles are the components with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def subpackage(module: str) -> str:
    """dsec.backends.vm.driver -> dsec.backends.vm; dsec.edge.edge -> dsec.edge; dsec.types -> itself."""
    parts = module.split(".")
    depth = 3 if len(parts) > 2 and parts[1] == "backends" else 2
    return ".".join(parts[:depth])


def modules_on_disk(package: str = "dsec") -> set[str]:
    """Every module the .py files under `package`'s directory would be, packages by their __init__."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, package
    root = Path(next(iter(spec.submodule_search_locations)))
    out = set()
    for f in root.rglob("*.py"):
        parts = (package, *f.relative_to(root).with_suffix("").parts)
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def unseen(graph_modules: set[str], on_disk: set[str]) -> list[str]:
    return [f"module not in the import graph (a package without __init__.py?): {m}"
            for m in sorted(on_disk - graph_modules)]


def violations() -> list[str]:
    graph = grimp.build_graph("dsec")
    modules = set(graph.modules)
    out = unseen(modules, modules_on_disk())
    edges = {m: set(graph.find_modules_directly_imported_by(m)) & modules for m in modules}
    out += [f"import cycle between modules: {' <-> '.join(c)}" for c in strongly_connected(modules, edges)]
    pkg_edges: dict[str, set[str]] = {}
    for m, targets in edges.items():
        for t in targets:
            if subpackage(m) != subpackage(t):
                pkg_edges.setdefault(subpackage(m), set()).add(subpackage(t))
    out += [f"import cycle between packages: {' <-> '.join(c)}"
            for c in strongly_connected({subpackage(m) for m in modules}, pkg_edges)]
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            if _within(t, CONCRETE_BACKENDS) and not _within(m, (subpackage(t), *MAY_COMPOSE)):
                out.append(f"{m} imports the concrete backend {t}: only the composition root may "
                           "(use dsec.backends.base)")
            if _within(m, ("dsec.edge",)) and _within(t, EDGE_MUST_NOT):
                out.append(f"the edge imports {t} ({m})")
            if _within(m, ("dsec.sdk",)) and not _within(t, SDK_MAY):
                out.append(f"the client SDK imports server-side {t} ({m})")
    return out


def main() -> int:
    found = violations()
    for v in found:
        print(v)
    print(f"architecture: {len(found)} violation(s) in {len(modules_on_disk())} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
