"""Adapters (dsec.adapters) sit on top of the client SDK: nothing in dsec imports them, and they
import nothing of dsec but the SDK, the shared types and the config (so they run on a
client-only install and never drag their framework into the core)."""

from __future__ import annotations

import grimp

ADAPTERS = "dsec.adapters"
ADAPTERS_MAY = ("dsec.sdk", "dsec.types", "dsec.config", ADAPTERS)


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_adapters_are_a_leaf_on_the_sdk() -> None:
    graph = grimp.build_graph("dsec")
    adapters = {m for m in graph.modules if _within(m, (ADAPTERS,))}
    assert "dsec.adapters.swerex" in adapters
    wrong = []
    for m in sorted(graph.modules):
        for t in sorted(graph.find_modules_directly_imported_by(m)):
            if _within(t, (ADAPTERS,)) and m not in adapters:
                wrong.append(f"{m} imports the adapter {t}")
            if m in adapters and t.startswith("dsec") and not _within(t, ADAPTERS_MAY):
                wrong.append(f"the adapter {m} imports {t}: adapters use the client SDK only")
    assert not wrong, "\n".join(wrong)
