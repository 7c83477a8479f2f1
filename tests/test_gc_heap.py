"""The server's startup heap is frozen out of the cyclic collector's walks (dsec/gc_heap.py):
a full collection then walks what requests allocate, not the ~100k objects of modules, the
app and its models (a 40-80 ms stall every few hundred requests before). In a fresh process
that imports what `dsec up` runs, so the figures are a server's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

PROBE = """
import gc, json, time
import dsec.embedded.server
from dsec.gc_heap import freeze_startup_heap

def full_ms():
    best = 1e9
    for _ in range(3):
        t = time.process_time(); gc.collect(); best = min(best, time.process_time() - t)
    return best * 1000

before = full_ms()
frozen = freeze_startup_heap()
after = full_ms()
print(json.dumps({"before_ms": before, "after_ms": after, "frozen": frozen, "tracked": len(gc.get_objects())}))
"""


def test_startup_heap_is_frozen_and_full_collections_skip_it():
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "PYTHONPATH": SRC},
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] > 50_000, got
    assert got["tracked"] < got["frozen"] / 10, got      # what a full collection still walks
    # CPU time (not wall): a loaded box slows both walks alike
    assert got["after_ms"] < got["before_ms"] / 3, got


def test_dsec_up_freezes_after_startup():
    """The embedded server calls it once the app is built, before it serves."""
    src = (Path(SRC) / "dsec/embedded/server.py").read_text()
    assert "freeze_startup_heap()" in src.split("await server.serve()")[0].split("def serve(")[1]
