"""Fixtures of the big `dsec bench images --suite env` run: a >= 1 GB Debian + Python data-stack
base built with debootstrap (cached), 10 workspace layers, a toolkit in two versions, the
monolithic EROFS image and the tar.gz of every environment (what a platform without layers
ships), and a store model with injected per-request latency and one shared bandwidth.

Everything is cached under the bench work dir (default /var/cache/dsec-bench) keyed by
content, so a second run skips the ~2 min debootstrap and the ~2 min of monolithic builds.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsec.config import Paths
from dsec.images.builder import debootstrap_cached, safe_rmtree
from dsec.images.erofs import mkfs
from dsec.images.lazy import manifest_file, write_manifest
from dsec.images.service import ImageService

BASE_PACKAGES = ["python3", "python3-numpy", "python3-scipy", "python3-pandas", "python3-sklearn",
                 "python3-matplotlib", "python3-sympy", "python3-pytest", "python3-dev",
                 "python3-pip", "build-essential", "gcc", "g++", "git", "python3-statsmodels",
                 "python3-requests", "python3-yaml"]
BASE_NAME = "bench-pyenv"
FIRST_CMD = "cd /work && python3 -c 'import app; print(app.NAME)'"
WORKLOAD = "cd /work && python3 -m app.workload"

_WORKLOAD_PY = '''"""A typical agent step: import the data stack, fit a model, plot, run the tests."""
import json, subprocess, sys
import numpy as np
import scipy.optimize, scipy.stats, scipy.sparse
import pandas as pd
import sklearn.linear_model, sklearn.ensemble, sklearn.model_selection
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import sympy
import yaml, requests
from app import core

x = np.random.default_rng(0).normal(size=(400, 8))
y = x @ np.arange(8) + 0.1
df = pd.DataFrame(x).assign(y=y)
m = sklearn.ensemble.RandomForestRegressor(n_estimators=5).fit(df.drop(columns="y"), df.y)
plt.plot(df.y[:50]); plt.savefig("/tmp/plot.png")
print(json.dumps({"score": round(float(m.score(df.drop(columns="y"), df.y)), 3),
                  "core": core.checksum(), "sym": str(sympy.diff(sympy.sin(sympy.Symbol("x"))))}))
'''


@dataclass
class Env:
    name: str
    ws: str                     # workspace layer name
    mono: Path                  # monolithic EROFS (base + workspace + toolkit)
    tgz_ws: Path                # gzip member of the workspace + toolkit tree
    size: int                   # monolithic image bytes


@dataclass
class Fixture:
    svc: ImageService
    base: str                   # base layer digest
    toolkit: str                # toolkit layer digest
    envs: list[Env]
    base_tgz: Path
    layer_digests: dict[str, str] = field(default_factory=dict)   # env name -> ws digest
    base_tree: Path | None = None


class SlowStore:
    """The same store cost model as lazyfs (--latency-ms, --bandwidth-mbps): each request
    waits `latency`, then moves its bytes over one link shared by all requests."""

    def __init__(self, latency_ms: float, bandwidth_mbps: float, request_bytes: int = 4 << 20):
        self.latency_s, self.bps = latency_ms / 1000, bandwidth_mbps * 1e6
        self.request_bytes = request_bytes
        self._lock = threading.Lock()
        self._next = 0.0

    def _delay(self, n: int) -> None:
        time.sleep(self.latency_s)
        if self.bps:
            with self._lock:
                start = max(time.monotonic(), self._next)
                self._next = done = start + n / self.bps
            time.sleep(max(0.0, done - time.monotonic()))

    def copy(self, src: Path, dst: Path) -> int:
        n = 0
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            while data := fi.read(self.request_bytes):
                self._delay(len(data))
                fo.write(data)
                n += len(data)
        return n

    def stream(self, srcs: list[Path], proc_stdin) -> int:
        """Feed the files, one after another, into a pipe (download piped into tar)."""
        n = 0
        for src in srcs:
            with open(src, "rb") as fi:
                while data := fi.read(self.request_bytes):
                    self._delay(len(data))
                    proc_stdin.write(data)
                    n += len(data)
        return n


def _gen_workspace(root: Path, i: int, version: int = 1) -> None:
    """A small repo: a package `app` with generated modules, tests and some data."""
    rnd = random.Random(i * 1000 + version)
    app = root / "work" / "app"
    app.mkdir(parents=True)
    (app / "__init__.py").write_text(f'NAME = "env{i}"\n')
    mods = []
    for k in range(60):
        body = "\n".join(f"def f{j}(x):\n    return x * {rnd.randint(1, 99)} + {j}\n"
                         for j in range(40))
        (app / f"m{k}.py").write_text(body)
        mods.append(f"m{k}")
    (app / "core.py").write_text(
        "import importlib\n"
        f"MODS = {mods[:20]!r}\n"
        "def checksum():\n"
        "    return sum(importlib.import_module('app.' + m).f1(1) for m in MODS)\n")
    (app / "workload.py").write_text(_WORKLOAD_PY)
    data = root / "work" / "data"
    data.mkdir()
    (data / "blob.bin").write_bytes(rnd.randbytes(12 << 20))   # fixtures / checkpoints
    (root / "work" / "tests").mkdir()
    (root / "work" / "tests" / "test_app.py").write_text(
        "from app import core\n\ndef test_checksum():\n    assert core.checksum() > 0\n")


def _gen_toolkit(root: Path, version: int) -> None:
    """The agent harness: tools on top of every environment (/opt/harness)."""
    rnd = random.Random(7777 + version)
    h = root / "opt" / "harness"
    (h / "bin").mkdir(parents=True)
    (h / "VERSION").write_text(f"{version}\n")
    for k in range(30):
        p = h / "bin" / f"tool{k}"
        p.write_text(f"#!/bin/sh\necho tool{k} v{version}\n")
        p.chmod(0o755)
    (h / "models.bin").write_bytes(rnd.randbytes(24 << 20))


def _io_write_bytes(pid: str = "self") -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def _tree_key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def build_fixture(work: Path, n_envs: int, chunk: int = 2 << 20, progress=print) -> Fixture:
    """Build (or reuse) the base, workspaces, toolkit and baseline images."""
    home = work / "home"
    svc = ImageService(Paths(home))
    t0 = time.monotonic()
    base_info = svc.build_debootstrap(BASE_NAME, include=BASE_PACKAGES) \
        if BASE_NAME not in {i.name for i in svc.list()} else svc.get(BASE_NAME)
    base = base_info.layers[0].digest
    _ensure_meta(svc, base, chunk)
    progress(f"base {BASE_NAME}: {base_info.size_bytes / 1e9:.2f} GB ({time.monotonic() - t0:.0f}s)")
    gen = work / "gen"
    tk = _layer_from(svc, gen, "harness@1", lambda r: _gen_toolkit(r, 1))
    envs: list[Env] = []
    base_tree = work / "base-tree"
    key = _tree_key(base, "v1")
    mono_dir = work / "mono"
    mono_dir.mkdir(exist_ok=True)
    base_tgz = work / f"base-{key}.tar.gz"
    for i in range(n_envs):
        ws = f"ws{i}@1"
        wsd = _layer_from(svc, gen, ws, lambda r, i=i: _gen_workspace(r, i))
        mono = mono_dir / f"env{i}-{key}.erofs"
        tgz = mono_dir / f"env{i}-{key}.tar.gz"
        if not mono.exists() or not tgz.exists():
            _ensure_base_tree(svc, base_tree, progress)
            extra = gen / f"mono-{i}"
            safe_rmtree(extra)
            _gen_workspace(extra, i)
            _gen_toolkit(extra, 1)
            _merge_and_mkfs(base_tree, extra, mono)
            subprocess.run(f"tar -C {extra} -c --numeric-owner . | gzip -6 > {tgz}.tmp",
                           shell=True, check=True)
            os.replace(f"{tgz}.tmp", tgz)
            safe_rmtree(extra)
            progress(f"monolithic env{i}: {mono.stat().st_size / 1e9:.2f} GB")
        envs.append(Env(f"env{i}", ws, mono, tgz, mono.stat().st_size))
        _ = wsd
    if not base_tgz.exists():
        _ensure_base_tree(svc, base_tree, progress)
        t1 = time.monotonic()
        # tar.gz baseline = this base member + the env's member (gzip members concatenate;
        # tar reads both with --ignore-zeros), i.e. the full image's tar.gz
        subprocess.run(f"tar -C {base_tree} -c --numeric-owner --xattrs . | gzip -6 > {base_tgz}.tmp",
                       shell=True, check=True)
        os.replace(f"{base_tgz}.tmp", base_tgz)
        progress(f"base tar.gz {base_tgz.stat().st_size / 1e9:.2f} GB ({time.monotonic() - t1:.0f}s)")
    fx = Fixture(svc, base, tk, envs, base_tgz)
    fx.layer_digests = {e.name: svc.get(e.ws, "name").layers[-1].digest for e in envs}
    for d in (tk, *fx.layer_digests.values()):
        _ensure_meta(svc, d, chunk)
    fx.base_tree = base_tree
    return fx


def _ensure_meta(svc: ImageService, digest: str, chunk: int = 2 << 20) -> None:
    """The bench's own store: (re)write a layer's manifest for the chunk size asked, with
    its metadata pack (layers built before packs existed have none)."""
    path = svc.layer_path(digest)
    man = manifest_file(path)
    try:
        m = json.loads(man.read_text())
        ok = "meta" in m and m["chunk"] == chunk
    except (OSError, ValueError, KeyError):
        ok = False
    if not ok:
        write_manifest(path, chunk)


def _layer_from(svc: ImageService, gen: Path, name: str, make) -> str:
    try:
        info = svc.get(name, "name")
    except Exception:
        d = gen / name.replace("@", "-")
        safe_rmtree(d)
        make(d)
        info = svc.build_layer(name, from_dir=d)
        safe_rmtree(d)
    digest = info.layers[-1].digest
    _ensure_meta(svc, digest)
    return digest


def _ensure_base_tree(svc: ImageService, tree: Path, progress) -> None:
    if (tree / "usr" / "bin").is_dir():
        return
    safe_rmtree(tree)
    progress("extracting the base tree (for the monolithic baselines)")
    debootstrap_cached(svc.paths, tree, "bookworm", BASE_PACKAGES)


def _merge_and_mkfs(base_tree: Path, extra: Path, out: Path) -> float:
    """mkfs the monolithic image: the base tree with the extra (workspace + toolkit) files
    copied in, then taken out again so the base tree can be reused."""
    added: list[Path] = []
    for top in sorted(extra.iterdir()):              # work/, opt/harness
        for sub in sorted(top.iterdir()):
            dst = base_tree / top.name / sub.name
            if dst.exists():
                raise RuntimeError(f"{dst} exists in the base tree")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(sub, dst, symlinks=True) if sub.is_dir() else shutil.copy2(sub, dst)
            added.append(dst)
    tmp = out.with_name(out.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        return mkfs(base_tree, tmp)
    finally:
        os.replace(tmp, out) if tmp.exists() else None
        for d in added:
            shutil.rmtree(d) if d.is_dir() and not d.is_symlink() else d.unlink()
