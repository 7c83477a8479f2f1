"""`dsec bench images`: time-to-ready and bytes fetched for one image, three ways, against a
store with injected per-request latency:

  lazy     EROFS mounted from the node's lazy FUSE view (chunks fetched on first read)
  full     the whole EROFS file copied from the store (same chunked requests), then mounted
  tar.gz   a tar.gz of the same tree fetched, unpacked, used as a directory

"Ready" = the image's startup command finished in a chroot of it (`python3 -c 'import json'`
where python3 exists, else `/bin/sh -c true`). Each way starts cold: empty chunk cache, page
cache of the store files dropped where possible.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.config import Paths
from dsec.images.builder import extract_tarball, safe_rmtree
from dsec.images.lazy import LazyView, write_manifest
from dsec.images.mounts import MNT_DETACH, MOUNT_FLAGS, sys_mount, sys_umount

if TYPE_CHECKING:
    from dsec.bench.imgenv import SlowStore


def _fetch(src: Path, dst: Path, chunk: int, latency_s: float) -> int:
    n = 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while data := fi.read(chunk):
            time.sleep(latency_s)
            fo.write(data)
            n += len(data)
    return n


def _startup(root: Path) -> list[str]:
    if (root / "usr" / "bin" / "python3").exists() or (root / "usr" / "bin" / "python3").is_symlink():
        return ["chroot", str(root), "/usr/bin/python3", "-c", "import json, subprocess"]
    return ["chroot", str(root), "/bin/sh", "-c", "true"]


def _drop_caches() -> None:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError:
        pass


def run_images_bench(image: str = "debian-python", latency_ms: float = 5.0,
                     chunk: int = 2 << 20) -> list[dict]:
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService
    svc = ImageService(Paths.from_env())
    try:
        info = svc.get(image)
    except Exception:
        info = ensure_builtin(svc, image)
    if len(info.layers) != 1:
        raise SystemExit("bench images takes a one-layer image")
    layer = svc.layer_path(info.layers[0].digest)
    lat = latency_ms / 1000
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-images-", dir="/var/tmp"))
    rows: list[dict] = []
    try:
        store = work / "store"
        store.mkdir()
        remote = store / layer.name
        shutil.copyfile(layer, remote)
        write_manifest(remote, chunk)
        # the tar.gz of the same tree
        mnt0 = work / "m0"
        mnt0.mkdir()
        sys_mount(str(remote), str(mnt0), "erofs", MOUNT_FLAGS, None)
        tgz = store / "image.tar.gz"
        try:
            subprocess.run(["tar", "-czf", str(tgz), "-C", str(mnt0), "--numeric-owner", "--xattrs",
                            "--xattrs-include=*", "."], check=True, capture_output=True)
        finally:
            sys_umount(str(mnt0), MNT_DETACH)

        # lazy
        _drop_caches()
        view = LazyView(Paths(work / "home"), store=store, chunk=chunk, latency_ms=latency_ms,
                        cache_bytes=8 << 30, root=work / "lazy")
        t0 = time.monotonic()
        src = view.source(info.layers[0].digest)
        mnt = work / "m-lazy"
        mnt.mkdir()
        sys_mount(str(src), str(mnt), "erofs", MOUNT_FLAGS, None)
        try:
            subprocess.run(_startup(mnt), check=True, capture_output=True)
            dt = time.monotonic() - t0
            rows.append({"way": "lazy", "bytes_fetched": view.stats()["fetched_bytes"],
                         "ready_s": dt})
        finally:
            sys_umount(str(mnt), MNT_DETACH)
            view.stop()

        # full copy
        _drop_caches()
        t0 = time.monotonic()
        local = work / "full.erofs"
        n = _fetch(remote, local, chunk, lat)
        mnt = work / "m-full"
        mnt.mkdir()
        sys_mount(str(local), str(mnt), "erofs", MOUNT_FLAGS, "directio")
        try:
            subprocess.run(_startup(mnt), check=True, capture_output=True)
            rows.append({"way": "full copy", "bytes_fetched": n, "ready_s": time.monotonic() - t0})
        finally:
            sys_umount(str(mnt), MNT_DETACH)

        # tar.gz unpack
        _drop_caches()
        t0 = time.monotonic()
        local_tgz = work / "local.tar.gz"
        n = _fetch(tgz, local_tgz, chunk, lat)
        root = work / "unpacked"
        extract_tarball(local_tgz, root)
        subprocess.run(_startup(root), check=True, capture_output=True)
        rows.append({"way": "tar.gz unpack", "bytes_fetched": n, "ready_s": time.monotonic() - t0})
        for r in rows:
            r.update(image=image, image_bytes=remote.stat().st_size, latency_ms=latency_ms,
                     chunk=chunk)
        return rows
    finally:
        for m in ("m0", "m-lazy", "m-full"):
            try:
                sys_umount(str(work / m), MNT_DETACH)
            except OSError:
                pass
        safe_rmtree(work)



# ---------------------------------------------------------------------------------------
# --suite env: the >= 1 GB environment, 10 environments, 50 sandboxes, toolkit upgrade
# ---------------------------------------------------------------------------------------

def _ovl(lowers: list[Path], sb: Path) -> Path:
    """Compose a sandbox rootfs as the edge does: lowerdirs top first, upper on local disk."""
    for d in ("upper", "work", "root"):
        (sb / d).mkdir(parents=True, exist_ok=True)
    opts = (f"lowerdir={':'.join(str(x) for x in lowers)},upperdir={sb / 'upper'},"
            f"workdir={sb / 'work'}")
    sys_mount("overlay", str(sb / "root"), "overlay", 0, opts)
    return sb / "root"


def _chroot(root: Path, cmd: str) -> str:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LC_ALL": "C.UTF-8",
           "MPLCONFIGDIR": "/tmp"}
    p = subprocess.run([shutil.which("chroot") or "/usr/sbin/chroot", str(root), "/bin/sh", "-c",
                        cmd], capture_output=True,
                       text=True, env=env, timeout=600)
    if p.returncode:
        raise RuntimeError(f"`{cmd}` failed in {root}: {p.stderr[-800:]}")
    return p.stdout


class _Node:
    """One node's state for a way: mounts made, dirs to clean, bytes written."""

    def __init__(self, work: Path, name: str):
        self.dir = work / name
        self.dir.mkdir(parents=True)
        self.mounts: list[Path] = []
        self.locks: dict[str, threading.Lock] = {}
        self.done: dict[str, Path] = {}
        self._guard = threading.Lock()

    def once(self, key: str, make) -> Path:
        """make() once per node per key (mount a layer, copy an image), others wait."""
        with self._guard:
            lock = self.locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self.done:
                self.done[key] = make()
            return self.done[key]

    def mount_erofs(self, src: Path, name: str) -> Path:
        mnt = self.dir / "m" / name
        mnt.mkdir(parents=True, exist_ok=True)
        sys_mount(str(src), str(mnt), "erofs", MOUNT_FLAGS, "directio")
        self.mounts.append(mnt)
        return mnt

    def cleanup(self) -> None:
        for m in reversed(self.mounts):
            try:
                sys_umount(str(m), MNT_DETACH)
            except OSError:
                pass
        safe_rmtree(self.dir)


def _lazy_view(work: Path, fx, name: str, *, latency_ms: float, bandwidth_mbps: float,
               chunk: int, meta: bool, prefetch: bool, profiles_from: Path | None = None) -> LazyView:
    root = work / name
    (root / "cache").mkdir(parents=True, exist_ok=True)
    if profiles_from is not None:           # the profiles a previous node recorded, no chunks
        for p in profiles_from.glob("*.profile.json"):
            shutil.copy(p, root / "cache" / p.name)
    return LazyView(Paths(work / "unused-home"), store=fx.svc.paths.store, chunk=chunk,
                    latency_ms=latency_ms, bandwidth_mbps=bandwidth_mbps, cache_bytes=64 << 30,
                    root=root, meta=meta, prefetch=prefetch)


def _reap_zombies() -> None:
    """Reap exited children (stopped lazy daemons) now, so their /proc io counters are
    added to ours before a measurement starts, not in the middle of one."""
    subprocess._cleanup()        # type: ignore[attr-defined]
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _view_writes(view: LazyView) -> int:
    from dsec.bench.imgenv import _io_write_bytes
    try:
        return _io_write_bytes((view.root / "pid").read_text().strip())
    except (OSError, ValueError):
        return 0


def _fractions(work: Path, fx, env, way: str, *, latency_ms: float, bandwidth_mbps: float,
               chunk: int, meta: bool, prefetch: bool, profiles_from: Path | None) -> dict:
    """One cold sandbox of `env`: bytes fetched after the first command and after the
    workload, and the time each took (mount included)."""
    from dsec.bench.imgenv import FIRST_CMD, WORKLOAD
    _drop_caches()
    view = _lazy_view(work, fx, f"lazy-{way}", latency_ms=latency_ms, bandwidth_mbps=bandwidth_mbps,
                      chunk=chunk, meta=meta, prefetch=prefetch, profiles_from=profiles_from)
    node = _Node(work, f"node-{way}")
    try:
        t0 = time.monotonic()
        lowers = [node.mount_erofs(view.source(d), n) for d, n in
                  ((fx.toolkit, "tk"), (fx.layer_digests[env.name], "ws"), (fx.base, "base"))]
        root = _ovl(lowers, node.dir / "sb0")
        node.mounts.append(root)
        _chroot(root, FIRST_CMD)
        t_first = time.monotonic() - t0
        first = view.stats()["fetched_bytes"]
        out = _chroot(root, WORKLOAD)
        t_work = time.monotonic() - t0
        st = view.stats()
        return {"way": way, "first_bytes": first, "work_bytes": st["fetched_bytes"],
                "meta_bytes": st.get("meta_bytes", 0), "prefetched": st.get("prefetched_bytes", 0),
                "requests": st.get("requests", 0), "first_s": t_first, "work_s": t_work,
                "out": out.strip()[-200:], "cache": view.cache}
    finally:
        node.cleanup()
        view.stop()


def _burst(work: Path, fx, way: str, n_sandboxes: int, parallel: int, ready_one) -> dict:
    """Start n sandboxes, env i % len(envs), `parallel` at a time; time to all ready."""
    from concurrent.futures import ThreadPoolExecutor
    from dsec.bench.imgenv import _io_write_bytes
    _drop_caches()
    _reap_zombies()
    w0 = _io_write_bytes()
    lat: list[float] = []
    t0 = time.monotonic()

    def one(j: int) -> None:
        s = time.monotonic()
        ready_one(j, fx.envs[j % len(fx.envs)])
        lat.append(time.monotonic() - s)

    with ThreadPoolExecutor(parallel) as ex:
        for f in [ex.submit(one, j) for j in range(n_sandboxes)]:
            f.result()
    total = time.monotonic() - t0
    lat.sort()
    return {"way": way, "sandboxes": n_sandboxes, "ready_all_s": total,
            "ready_p50_s": lat[len(lat) // 2], "written": _io_write_bytes() - w0}


def _burst_lazy(work, fx, way, n, parallel, *, profiles_from=None, **kw) -> dict:
    from dsec.bench.imgenv import FIRST_CMD
    view = _lazy_view(work, fx, f"lazy-{way}", profiles_from=profiles_from, **kw)
    node = _Node(work, f"node-{way}")
    try:
        def ready(j, env):
            lowers = [node.once(d, lambda d=d: node.mount_erofs(view.source(d), d[7:19]))
                      for d in (fx.toolkit, fx.layer_digests[env.name], fx.base)]
            root = _ovl(lowers, node.dir / f"sb{j}")
            with node._guard:
                node.mounts.append(root)
            _chroot(root, FIRST_CMD)
        r = _burst(work, fx, way, n, parallel, ready)
        r["written"] += _view_writes(view)
        r["fetched"] = view.stats()["fetched_bytes"]
        r["cache"] = view.cache
        return r
    finally:
        node.cleanup()
        view.stop()


def _burst_full(work, fx, way, n, parallel, store: "SlowStore", layered: bool) -> dict:
    from dsec.bench.imgenv import FIRST_CMD
    node = _Node(work, f"node-{way}")
    fetched = [0]
    try:
        def copy_mount(src: Path, name: str) -> Path:
            local = node.dir / f"{name}.erofs"
            n = store.copy(src, local)
            with node._guard:
                fetched[0] += n
            return node.mount_erofs(local, name)

        def ready(j, env):
            if layered:          # eager pull of the layered image: base once per node
                lowers = [node.once(d, lambda d=d: copy_mount(fx.svc.layer_path(d), d[7:19]))
                          for d in (fx.toolkit, fx.layer_digests[env.name], fx.base)]
            else:                # the environment's monolithic image, once per node
                lowers = [node.once(env.name, lambda: copy_mount(env.mono, env.name))]
            root = _ovl(lowers, node.dir / f"sb{j}")
            with node._guard:
                node.mounts.append(root)
            _chroot(root, FIRST_CMD)
        r = _burst(work, fx, way, n, parallel, ready)
        r["fetched"] = fetched[0]
        return r
    finally:
        node.cleanup()


def _burst_tar(work, fx, way, n, parallel, store: "SlowStore") -> dict:
    """Per sandbox: download the environment's tar.gz and unpack it (streamed into tar)."""
    from dsec.bench.imgenv import FIRST_CMD
    node = _Node(work, f"node-{way}")
    fetched = [0]
    try:
        def ready(j, env):
            root = node.dir / f"sb{j}"
            root.mkdir()
            p = subprocess.Popen(["tar", "-xzf", "-", "-i", "-C", str(root), "--numeric-owner",
                                  "--same-owner", "--same-permissions", "--xattrs"],
                                 stdin=subprocess.PIPE, stderr=subprocess.PIPE)
            assert p.stdin is not None
            n = store.stream([fx.base_tgz, env.tgz_ws], p.stdin)
            with node._guard:
                fetched[0] += n
            p.stdin.close()
            if p.wait():
                raise RuntimeError(f"tar failed: {p.stderr.read()[-500:]!r}")
            _chroot(root, FIRST_CMD)
            shutil.rmtree(root)         # keep the disk bounded; its writes are counted
        r = _burst(work, fx, way, n, parallel, ready)
        r["fetched"] = fetched[0]
        return r
    finally:
        node.cleanup()


def _toolkit_upgrade(work: Path, fx, n_workspaces: int, mono_sample: int) -> dict:
    """New toolkit version for n workspaces: one layer build vs rebuilding every
    monolithic image (mono_sample of them rebuilt for real, the rest scaled linearly)."""
    from dsec.bench.imgenv import (_gen_toolkit, _gen_workspace, _io_write_bytes,
                                   _merge_and_mkfs, _ensure_base_tree)
    gen = work / "upgrade"
    tk = gen / "harness-2"
    _gen_toolkit(tk, 2)
    try:
        fx.svc.remove("harness@2")
    except Exception:
        pass
    _drop_caches()
    w0, t0 = _io_write_bytes(), time.monotonic()
    fx.svc.build_layer("harness@2", from_dir=tk)
    layered = {"seconds": time.monotonic() - t0, "written": _io_write_bytes() - w0}
    fx.svc.remove("harness@2")
    _ensure_base_tree(fx.svc, fx.base_tree, lambda m: None)
    secs, written = 0.0, 0
    for i in range(mono_sample):
        extra = gen / f"mono{i}"
        _gen_workspace(extra, i)
        shutil.copytree(tk / "opt", extra / "opt")
        out = gen / f"mono{i}.erofs"
        w0, t0 = _io_write_bytes(), time.monotonic()
        _merge_and_mkfs(fx.base_tree, extra, out)
        with open(out, "rb") as f:
            os.fsync(f.fileno())
        secs += time.monotonic() - t0
        written += _io_write_bytes() - w0
        out.unlink()
        safe_rmtree(extra)
    safe_rmtree(gen)
    scale = n_workspaces / mono_sample
    return {"n": n_workspaces, "layered_s": layered["seconds"], "layered_written": layered["written"],
            "mono_sample": mono_sample, "mono_s": secs * scale, "mono_written": int(written * scale),
            "mono_s_each": secs / mono_sample}


def run_env_bench(work: Path = Path("/var/cache/dsec-bench"), n_envs: int = 10,
                  n_sandboxes: int = 50, parallel: int = 2, latency_ms: float = 2.0,
                  bandwidth_mbps: float = 100.0, chunk: int = 2 << 20, n_workspaces: int = 100,
                  mono_sample: int = 3, tar_sample: int = 6, progress=print) -> dict:
    from dsec.bench.imgenv import SlowStore, build_fixture
    work.mkdir(parents=True, exist_ok=True)
    fx = build_fixture(work, n_envs, chunk, progress=progress)
    run = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    kw = dict(latency_ms=latency_ms, bandwidth_mbps=bandwidth_mbps, chunk=chunk)
    env = fx.envs[0]
    env_bytes = sum(fx.svc.layer_path(d).stat().st_size
                    for d in (fx.base, fx.toolkit, fx.layer_digests[env.name]))
    res: dict = {"env_bytes": env_bytes, "mono_bytes": env.size, "fractions": [], "burst": [],
                 "base_bytes": fx.svc.layer_path(fx.base).stat().st_size}
    try:
        progress("fractions: one cold sandbox, first command then workload")
        f0 = _fractions(run, fx, env, "no-meta", meta=False, prefetch=False, profiles_from=None, **kw)
        res["fractions"].append(f0)
        f1 = _fractions(run, fx, env, "meta", meta=True, prefetch=False, profiles_from=None, **kw)
        res["fractions"].append(f1)
        f2 = _fractions(run, fx, env, "meta+profile", meta=True, prefetch=True,
                        profiles_from=f1["cache"], **kw)
        res["fractions"].append(f2)
        for f in res["fractions"]:
            progress(f"  {f['way']}: first {f['first_bytes'] / env_bytes:.1%} in {f['first_s']:.2f}s, "
                     f"workload {f['work_bytes'] / env_bytes:.1%} in {f['work_s']:.2f}s")
        store = SlowStore(latency_ms, bandwidth_mbps)
        progress(f"burst: {n_sandboxes} sandboxes of {n_envs} environments, {parallel} at a time")
        b = _burst_lazy(run, fx, "lazy", n_sandboxes, parallel, meta=True, prefetch=False, **kw)
        res["burst"].append(b)
        res["burst"].append(_burst_lazy(run, fx, "lazy + profiles", n_sandboxes, parallel, meta=True,
                                        prefetch=True, profiles_from=b["cache"], **kw))
        res["burst"].append(_burst_full(run, fx, "full copy (monolithic)", n_sandboxes, parallel,
                                        store, layered=False))
        res["burst"].append(_burst_full(run, fx, "full copy (layers)", n_sandboxes, parallel,
                                        store, layered=True))
        # every tar.gz sandbox does the same independent work (download + unpack ~1.5 GB), so
        # tar_sample of them run for real and the totals scale linearly to n_sandboxes
        k = max(parallel, min(tar_sample, n_sandboxes))
        t = _burst_tar(run, fx, "tar.gz unpack per sandbox", k, parallel, store)
        if k < n_sandboxes:
            f = n_sandboxes / k
            t.update(way=f"tar.gz unpack per sandbox ({k} run, x{f:.1f})", sandboxes=n_sandboxes,
                     ready_all_s=t["ready_all_s"] * f, written=int(t["written"] * f),
                     fetched=int(t["fetched"] * f))
        res["burst"].append(t)
        for r in res["burst"]:
            progress(f"  {r['way']}: all ready in {r['ready_all_s']:.1f}s, "
                     f"written {r['written'] / 1e9:.2f} GB, fetched {r['fetched'] / 1e9:.2f} GB")
        progress(f"toolkit upgrade for {n_workspaces} workspaces")
        res["upgrade"] = _toolkit_upgrade(run, fx, n_workspaces, mono_sample)
    finally:
        safe_rmtree(run)
    for rows in (res["fractions"], res["burst"]):
        for r in rows:
            r.pop("cache", None)
    res.update(tar_sample=tar_sample, n_envs=n_envs, n_sandboxes=n_sandboxes, parallel=parallel, latency_ms=latency_ms,
               bandwidth_mbps=bandwidth_mbps, chunk=chunk)
    return res
