"""On-demand layer loading through the lazy FUSE view (Debian python3-pyfuse3): bytes
fetched, verification, the LRU bound, restarts, failing and slow stores. Real FUSE, real
file-backed EROFS mounts on top of it."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from dsec.config import Paths
from dsec.images import ImageService, LayerMounts
from dsec.images.lazy import LazyView, manifest_file

CHUNK = 1 << 20

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["/usr/bin/python3", "-c", "import pyfuse3"],
                                        capture_output=True).returncode != 0,
    reason="needs root and python3-pyfuse3")


@pytest.fixture
def built(tmp_path: Path):
    """A layer with one 24 MiB random file and a small text file."""
    paths = Paths(tmp_path / "home")
    svc = ImageService(paths)
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "data" / "big").write_bytes(os.urandom(24 << 20))
    (src / "small.txt").write_text("hello\n")
    info = svc.build_from_dir("big", src)
    digest = info.layers[0].digest
    assert manifest_file(svc.layer_path(digest)).is_file()     # recorded at build
    views: list[LazyView] = []
    mounts: list[LayerMounts] = []

    def view(**kw) -> tuple[LazyView, Path]:
        v = LazyView(paths, chunk=CHUNK, **kw)
        m = LayerMounts(paths, source=v.source)
        views.append(v)
        mounts.append(m)
        return v, m.ensure_mounted(digest)

    yield paths, svc, digest, src, view
    for m in mounts:
        m.unmount_all()
    for v in views:
        v.stop()


def _fetched(v: LazyView) -> int:
    return v.stats()["fetched_bytes"]


def test_lazy_reads_little_and_verifies(built):
    paths, svc, digest, src, view = built
    # manifests use the build's default chunk; rewrite at 1 MiB for this test
    from dsec.images.lazy import write_manifest
    write_manifest(svc.layer_path(digest), CHUNK)
    v, mnt = view()
    size = svc.layer_path(digest).stat().st_size
    assert (mnt / "small.txt").read_text() == "hello\n"
    small = _fetched(v)
    assert 0 < small <= 4 * CHUNK < size / 4, (small, size)
    assert (mnt / "data" / "big").read_bytes() == (src / "data" / "big").read_bytes()
    assert _fetched(v) >= 24 << 20


def test_cache_survives_restart_and_is_bounded(built):
    paths, svc, digest, src, view = built
    from dsec.images.lazy import write_manifest
    write_manifest(svc.layer_path(digest), CHUNK)
    v, mnt = view(cache_bytes=6 * CHUNK)
    (mnt / "small.txt").read_text()
    with open(mnt / "data" / "big", "rb") as f:
        f.read()
    used = sum(p.stat().st_size for p in (v.cache / digest[7:]).iterdir())
    assert used <= 6 * CHUNK
    assert v.stats()["evicted_chunks"] > 0
    # restart the view: cached chunks are reused, not fetched again
    LayerMounts(paths, source=v.source).unmount_all()
    v.stop()
    v2, mnt2 = view(cache_bytes=6 * CHUNK)
    before = _fetched(v2)
    assert (mnt2 / "small.txt").read_text() == "hello\n"
    assert _fetched(v2) == before


def test_corrupt_store_gives_eio_not_bad_data(built):
    paths, svc, digest, src, view = built
    from dsec.images.lazy import write_manifest
    layer = svc.layer_path(digest)
    write_manifest(layer, CHUNK)
    v, mnt = view()
    (mnt / "small.txt").read_text()
    # flip bytes in the middle of the big file's data, in the store only
    with open(layer, "r+b") as f:
        f.seek(12 << 20)
        blk = f.read(4096)
        f.seek(12 << 20)
        f.write(bytes(b ^ 0xFF for b in blk))
    with pytest.raises(OSError) as e:
        (mnt / "data" / "big").read_bytes()
    assert e.value.errno == errno.EIO
    assert v.stats()["errors"] >= 1


def test_slow_store_times_out_with_eio(built):
    paths, svc, digest, src, view = built
    from dsec.images.lazy import write_manifest
    write_manifest(svc.layer_path(digest), CHUNK)
    # warm the metadata chunks (mounting reads the superblock), then make the store slow
    v, mnt = view()
    assert (mnt / "small.txt").read_text() == "hello\n"
    LayerMounts(paths, source=v.source).unmount_all()
    v.stop()
    v2, mnt2 = view(latency_ms=5000, timeout_s=0.5)   # 5 s per fetch > 0.5 s timeout
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        (mnt2 / "data" / "big").read_bytes()
    assert e.value.errno == errno.EIO
    assert time.monotonic() - t0 < 30


def test_failing_store_gives_eio(built):
    paths, svc, digest, src, view = built
    from dsec.images.lazy import write_manifest
    layer = svc.layer_path(digest)
    write_manifest(layer, CHUNK)
    v, mnt = view()
    (mnt / "small.txt").read_text()
    layer.rename(layer.with_name("moved"))           # the store loses the file
    try:
        with pytest.raises(OSError) as e:
            (mnt / "data" / "big").read_bytes()
        assert e.value.errno == errno.EIO
    finally:
        layer.with_name("moved").rename(layer)


def test_sandbox_runs_from_the_lazy_view(tmp_path):
    """A server with DSEC_LAZY=1 mounts its layers through the lazy view; a sandbox starts
    having fetched only part of the image."""
    import asyncio
    import tempfile

    from conftest import ServerProc, _cleanup_home
    from dsec.images import ensure_builtin
    from dsec.images.mounts import mountinfo

    home = Path(tempfile.mkdtemp(prefix="dsec-lazy-", dir="/var/tmp"))
    try:
        paths = Paths(home)
        paths.ensure()
        info = ensure_builtin(ImageService(paths), "busybox")
        srv = ServerProc(home, env={"DSEC_LAZY": "1"})
        srv.start()
        try:
            async def go():
                async with srv.client() as c:
                    async with await c.create_container(image="busybox") as sb:
                        return (await sb.run("echo hi; ls /bin | wc -l")).stdout
            out = asyncio.run(go())
            assert out.startswith("hi\n")
            view = LazyView(paths)
            assert view.is_mounted()
            src = [m.source for m in mountinfo() if m.fstype == "erofs"
                   and m.mountpoint.startswith(str(paths.layer_mounts))]
            assert src and all(s.startswith(str(view.mnt)) for s in src), src
            st = view.stats()
            assert 0 < st["fetched_bytes"] and st["errors"] == 0
            assert st["fetched_bytes"] <= info.size_bytes
        finally:
            srv.kill()
    finally:
        LayerMounts(Paths(home)).unmount_all()
        LazyView(Paths(home)).stop()
        _cleanup_home(home)
