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
            # data chunks never exceed the image; the metadata pack is a small extra copy
            assert st["fetched_bytes"] - st["meta_bytes"] <= info.size_bytes
        finally:
            srv.kill()
    finally:
        LayerMounts(Paths(home)).unmount_all()
        LazyView(Paths(home)).stop()
        _cleanup_home(home)


def test_metadata_pack_keeps_tree_walks_off_the_data(built):
    """A full tree walk (stat, readdir, readlink) is served from the metadata pack: no data
    chunk is fetched until file contents are read."""
    from dsec.images.lazy import meta_file, write_manifest
    paths, svc, digest, src, view = built
    layer = svc.layer_path(digest)
    write_manifest(layer, CHUNK)
    assert meta_file(layer).is_file()
    v, mnt = view()
    for root, dirs, files in os.walk(mnt):
        for n in dirs + files:
            os.lstat(os.path.join(root, n))
    st = v.stats()
    assert st["fetched_bytes"] == st["meta_bytes"] > 0, st
    assert (mnt / "data" / "big").read_bytes() == (src / "data" / "big").read_bytes()
    assert v.stats()["fetched_bytes"] - v.stats()["meta_bytes"] >= 24 << 20


def test_access_profile_persists_and_prefetches(built, tmp_path):
    """The chunks a sandbox reads are recorded next to the cache (kept across restarts);
    the next view with that profile and an empty cache fetches them in bulk up front."""
    import shutil
    from dsec.images.lazy import write_manifest
    paths, svc, digest, src, view = built
    write_manifest(svc.layer_path(digest), CHUNK)
    v, mnt = view(prefetch=False)
    (mnt / "data" / "big").read_bytes()
    prof = v.profile(digest)
    assert prof and len(prof["data"]) >= 24 and prof["meta"]
    LayerMounts(paths, source=v.source).unmount_all()
    v.stop()
    assert LazyView(paths).profile(digest) == prof                 # survives the restart
    # a fresh node: no chunks, only the profile
    for p in v.cache.iterdir():
        if not p.name.endswith(".profile.json"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    v2, mnt2 = view(prefetch=True)
    deadline = time.monotonic() + 30
    while v2.stats().get("prefetched_bytes", 0) < 24 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    st = v2.stats()
    assert st["prefetched_bytes"] >= 24 << 20, st
    assert st["requests"] < len(prof["data"])                    # coalesced large requests
    (mnt2 / "data" / "big").read_bytes()
    assert v2.stats()["fetched_bytes"] == st["fetched_bytes"]      # all served from the cache


def test_erofs_metadata_parser_rejects_garbage(tmp_path):
    from dsec.images.erofsmeta import metadata_blocks
    bad = tmp_path / "x.erofs"
    bad.write_bytes(os.urandom(8192))
    with pytest.raises(ValueError):
        metadata_blocks(bad)
