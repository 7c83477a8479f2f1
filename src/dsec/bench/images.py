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

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from dsec.config import Paths
from dsec.images.builder import extract_tarball, safe_rmtree
from dsec.images.lazy import LazyView, write_manifest
from dsec.images.mounts import MNT_DETACH, MOUNT_FLAGS, sys_mount, sys_umount


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

