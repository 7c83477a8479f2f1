"""Images: real mkfs.erofs, real file-backed EROFS mounts, real tar and debootstrap. No mocks.

Needs root (mount(2), chown, chroot). Every test uses its own DSEC_HOME under tmp_path and
unmounts everything it mounted; the module checks no EROFS mount of ours is left behind.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from dsec.config import Paths
from dsec.images import ImageService, LayerMounts, ensure_builtin
from dsec.images.mounts import mountinfo
from dsec.images.store import image_digest
from dsec.types import Conflict, InvalidArgument, NotFound

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.erofs") is None,
    reason="needs root and erofs-utils (mkfs.erofs)")

STAMP = 1_700_000_000


def _our_mounts(paths: Paths) -> list:
    home = str(paths.home.resolve())
    return [m for m in mountinfo() if m.mountpoint.startswith(home + "/") or m.source.startswith(home + "/")]


@pytest.fixture
def paths(tmp_path: Path):
    p = Paths(tmp_path / "home")
    yield p
    LayerMounts(p).unmount_all()
    assert _our_mounts(p) == []


@pytest.fixture
def svc(paths: Paths) -> ImageService:
    return ImageService(paths)


@pytest.fixture(scope="module", autouse=True)
def _no_erofs_left_behind(tmp_path_factory):
    # only this module's homes (under pytest's tmp dir): other servers may mount meanwhile
    base = str(tmp_path_factory.getbasetemp())
    ours = lambda: {m.mountpoint for m in mountinfo() if m.fstype == "erofs" and m.mountpoint.startswith(base)}  # noqa: E731
    before = ours()
    yield
    after = ours()
    assert after - before == set(), f"EROFS mounts left behind: {after - before}"


def make_tree(root: Path, *, variant: str = "a", reverse: bool = False) -> Path:
    """A small rootfs-like tree with odd owners, modes, a symlink, a hardlink and an xattr;
    all mtimes fixed, so two calls give identical trees whatever the creation order."""
    rng = random.Random(variant)
    root.mkdir(parents=True)
    steps = []
    steps.append(lambda: (root / "etc").mkdir())
    steps.append(lambda: (root / "secret").mkdir(mode=0o750))
    steps.append(lambda: (root / "bin").mkdir())
    steps.append(lambda: (root / "tmp").mkdir())
    for s in (reversed(steps) if reverse else steps):
        s()
    (root / "etc" / "hello.txt").write_text(f"hello {variant}\n")
    os.link(root / "etc" / "hello.txt", root / "etc" / "hello-hardlink")
    os.setxattr(root / "etc" / "hello.txt", "user.dsec", b"yes")
    (root / "secret" / "data.bin").write_bytes(rng.randbytes(300_000))
    os.chmod(root / "secret" / "data.bin", 0o600)
    os.chown(root / "secret" / "data.bin", 1234, 2345)
    os.chown(root / "secret", 1234, 2345)
    os.chmod(root / "secret", 0o750)
    (root / "bin" / "tool").write_bytes(b"#!/bin/sh\necho tool\n")
    os.chmod(root / "bin" / "tool", 0o4755)
    os.chmod(root / "tmp", 0o1777)
    os.symlink("etc/hello.txt", root / "link")
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for n in dirnames + filenames:
            os.utime(os.path.join(dirpath, n), (STAMP, STAMP), follow_symlinks=False)
    os.utime(root, (STAMP, STAMP))
    return root


def losetup() -> str:
    return subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout


def store_files(paths: Paths) -> list[str]:
    # <hex>.chunks.json (per-chunk digests for lazy loading) and <hex>.meta (its EROFS
    # metadata, packed) accompany each layer file
    return sorted(p.name for p in paths.store.iterdir()
                  if p.name != ".lock" and not p.name.endswith((".chunks.json", ".meta")))


def leftovers(paths: Paths) -> list[str]:
    """Temp files or scratch trees that a finished build must not leave."""
    out = [p.name for p in paths.store.iterdir() if p.name.startswith(".tmp")]
    build = paths.home / "build"
    if build.is_dir():
        out += [str(p) for p in build.iterdir()]
    return out


# ---------------------------------------------------------------------------------------


def test_build_from_dir_mount_preserves_content_owners_modes(svc: ImageService, tmp_path):
    tree = make_tree(tmp_path / "tree")
    info = svc.build_from_dir("tiny", tree)
    assert info.name == "tiny" and len(info.layers) == 1
    layer = info.layers[0]
    assert layer.digest.startswith("sha256:") and layer.source == f"dir:{tree}"
    assert info.digest == image_digest([layer.digest])
    assert svc.layer_path(layer.digest) == svc.paths.store / f"{layer.digest[7:]}.erofs"
    assert layer.size_bytes == svc.layer_path(layer.digest).stat().st_size

    [mnt] = svc.mount_image("tiny")
    assert mnt == svc.paths.layer_mounts / layer.digest[7:]
    assert (mnt / "etc" / "hello.txt").read_text() == "hello a\n"
    assert (mnt / "secret" / "data.bin").read_bytes() == (tree / "secret" / "data.bin").read_bytes()
    st = (mnt / "secret" / "data.bin").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 2345, 0o600)
    st = (mnt / "secret").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 2345, 0o750)
    assert stat.S_IMODE((mnt / "bin" / "tool").stat().st_mode) == 0o4755
    assert stat.S_IMODE((mnt / "tmp").stat().st_mode) == 0o1777
    assert os.readlink(mnt / "link") == "etc/hello.txt"
    assert (mnt / "link").read_text() == "hello a\n"
    a, b = (mnt / "etc" / "hello.txt").stat(), (mnt / "etc" / "hello-hardlink").stat()
    assert a.st_ino == b.st_ino and a.st_nlink == 2
    assert os.getxattr(mnt / "etc" / "hello.txt", "user.dsec") == b"yes"
    assert int(a.st_mtime) == STAMP
    with pytest.raises(OSError) as e:
        (mnt / "new").write_text("x")
    assert e.value.errno == errno.EROFS
    # by digest too, and listing
    assert svc.get(info.digest).name == "tiny"
    assert [i.name for i in svc.list()] == ["tiny"]
    assert leftovers(svc.paths) == []


def test_mount_is_file_backed_erofs_directio_without_loop(svc: ImageService, tmp_path):
    loops_before = losetup()
    info = svc.build_from_dir("tiny", make_tree(tmp_path / "tree"))
    t0 = time.monotonic()
    [mnt] = svc.mount_image("tiny")
    mount_s = time.monotonic() - t0
    entries = [m for m in mountinfo() if m.mountpoint == str(mnt.resolve())]
    assert len(entries) == 1, entries
    m = entries[0]
    assert m.fstype == "erofs"
    assert m.source == str(svc.layer_path(info.layers[0].digest))   # the file, not /dev/loopN
    assert "directio" in m.super_options.split(",")
    opts = m.options.split(",")
    assert "ro" in opts and "nosuid" in opts and "nodev" in opts
    assert m.major_minor.split(":")[0] == "0"          # anonymous device: no block device
    assert losetup() == loops_before
    assert mount_s < 1.0
    # idempotent
    assert svc.mount_image("tiny") == [mnt]
    assert len([x for x in mountinfo() if x.mountpoint == str(mnt.resolve())]) == 1
    # unmount removes the mount and its dir
    assert svc.mounts.unmount(info.layers[0].digest) is True
    assert not mnt.exists() and not svc.mounts.is_mounted(info.layers[0].digest)
    assert svc.mounts.unmount(info.layers[0].digest) is False


def test_lz4_compressed_layer(svc: ImageService, tmp_path):
    tree = make_tree(tmp_path / "tree")
    plain = svc.build_from_dir("plain", tree)
    lz4 = svc.build_from_dir("lz4", tree, compression="lz4")
    assert lz4.digest != plain.digest
    [mnt] = svc.mount_image("lz4")
    assert (mnt / "secret" / "data.bin").read_bytes() == (tree / "secret" / "data.bin").read_bytes()
    with pytest.raises(InvalidArgument) as e:
        svc.build_from_dir("zz", tree, compression="gzip")
    assert e.value.field == "compression"


def test_same_content_same_digest_dedup(svc: ImageService, tmp_path):
    one = svc.build_from_dir("one", make_tree(tmp_path / "t1"))
    two = svc.build_from_dir("two", make_tree(tmp_path / "t2", reverse=True))
    assert one.digest == two.digest
    assert one.layers[0].digest == two.layers[0].digest
    assert store_files(svc.paths) == [f"{one.layers[0].digest[7:]}.erofs"]
    # same name, same content: no conflict, same image
    again = svc.build_from_dir("one", make_tree(tmp_path / "t3"))
    assert again.digest == one.digest and again.created_at == one.created_at
    # removing one name keeps the shared layer for the other
    assert svc.remove("one") == []
    assert store_files(svc.paths) == [f"{one.layers[0].digest[7:]}.erofs"]
    assert (svc.mount_image("two")[0] / "etc" / "hello.txt").read_text() == "hello a\n"


def _tar(src: Path, out: Path, *flags: str) -> Path:
    subprocess.run(["tar", "-c", *flags, "-f", str(out), "-C", str(src), "--numeric-owner",
                    "--xattrs", "--xattrs-include=*", "--format=posix", "."], check=True)
    return out


@pytest.mark.parametrize("flags,suffix", [((), ".tar"), (("-z",), ".tar.gz"), (("--zstd",), ".tar.zst")])
def test_build_from_tarball(svc: ImageService, tmp_path, flags, suffix):
    tree = make_tree(tmp_path / "tree")
    tarball = _tar(tree, tmp_path / f"rootfs{suffix}", *flags)
    events: list = []
    info = svc.build_from_tar("fromtar", tarball, progress=lambda msg, frac: events.append((msg, frac)))
    assert info.layers[0].source == f"tar:{tarball}"
    assert any(m.startswith("extracting") for m, _ in events) and events[-1][1] == 1.0
    [mnt] = svc.mount_image("fromtar")
    st = (mnt / "secret" / "data.bin").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 2345, 0o600)
    assert os.getxattr(mnt / "etc" / "hello.txt", "user.dsec") == b"yes"
    # a tarball of a tree gives the very same image as the tree itself
    assert svc.build_from_dir("fromdir", tree).digest == info.digest
    assert leftovers(svc.paths) == []


def test_truncated_or_corrupt_tarball_is_rejected_cleanly(svc: ImageService, tmp_path):
    tree = make_tree(tmp_path / "tree")
    good_gz = _tar(tree, tmp_path / "good.tar.gz", "-z").read_bytes()
    good_tar = _tar(tree, tmp_path / "good.tar").read_bytes()
    cases = {
        "cut.tar.gz": good_gz[: len(good_gz) // 2],
        "cut.tar": good_tar[:1500],                         # GNU tar alone accepts this one
        "cut-mid-data.tar": good_tar[: len(good_tar) // 2],
        "garbage.tar": os.urandom(10_000),
        "empty.tar": b"",
    }
    for name, data in cases.items():
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(InvalidArgument) as e:
            svc.build_from_tar("bad", bad)
        assert e.value.field == "tarball", name
        assert str(bad) in e.value.message and e.value.fix, name
        if name.startswith("cut"):
            assert "truncated" in e.value.message, (name, e.value.message)
    with pytest.raises(InvalidArgument) as e:
        svc.build_from_tar("bad", tmp_path / "missing.tar.gz")
    assert e.value.field == "tarball" and "no such file" in e.value.message
    # nothing registered, nothing left behind
    assert svc.list() == []
    assert store_files(svc.paths) == []
    assert leftovers(svc.paths) == []
    with sqlite3.connect(svc.paths.images_db) as db:
        assert db.execute("SELECT count(*) FROM layers").fetchone()[0] == 0


def test_tar_members_cannot_escape(svc: ImageService, tmp_path):
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w", format=tarfile.PAX_FORMAT) as tf:
        for name in ("ok.txt", "../escaped.txt", "/abs-escaped.txt"):
            ti = tarfile.TarInfo(name)
            ti.size = 3
            tf.addfile(ti, fileobj=__import__("io").BytesIO(b"hi\n"))
    with pytest.raises(InvalidArgument) as e:
        svc.build_from_tar("evil", evil)
    assert e.value.field == "tarball" and "outside the root directory" in e.value.message
    assert svc.list() == [] and store_files(svc.paths) == []
    assert not (tmp_path / "escaped.txt").exists()
    assert not Path("/abs-escaped.txt").exists()
    assert not list((svc.paths.home).rglob("escaped.txt"))
    assert leftovers(svc.paths) == []


def _plant_layer(paths: Paths, data: bytes) -> str:
    import hashlib
    hexd = hashlib.sha256(data).hexdigest()
    (paths.store / f"{hexd}.erofs").write_bytes(data)
    return f"sha256:{hexd}"


def test_corrupt_erofs_gives_clear_error_and_no_leftover_mount(svc: ImageService, tmp_path):
    digest = _plant_layer(svc.paths, os.urandom(64 * 1024))
    with pytest.raises(InvalidArgument) as e:
        svc.mounts.ensure_mounted(digest)
    assert e.value.field == "layer" and "not an EROFS image" in e.value.message
    assert not svc.mounts.mountpoint(digest).exists()
    # right magic, damaged superblock: only the kernel can tell
    info = svc.build_from_dir("tiny", make_tree(tmp_path / "tree"))
    data = bytearray(svc.layer_path(info.layers[0].digest).read_bytes())
    for off in range(1024 + 8, 1024 + 96):
        data[off] ^= 0x5A
    digest2 = _plant_layer(svc.paths, bytes(data))
    with pytest.raises(InvalidArgument) as e:
        svc.mounts.ensure_mounted(digest2)
    assert e.value.field == "layer" and "kernel refused" in e.value.message
    assert not svc.mounts.mountpoint(digest2).exists()
    assert _our_mounts(svc.paths) == []
    with pytest.raises(NotFound):
        svc.mounts.ensure_mounted("sha256:" + "0" * 64)


def test_name_clash_conflict_and_replace(svc: ImageService, tmp_path, monkeypatch):
    from dsec.images import store
    a = svc.build_from_dir("img", make_tree(tmp_path / "a", variant="a"))
    files_a = store_files(svc.paths)
    with pytest.raises(Conflict) as e:
        svc.build_from_dir("img", make_tree(tmp_path / "b", variant="b"))
    assert e.value.field == "name" and "replace=True" in e.value.fix
    assert svc.get("img").digest == a.digest
    assert store_files(svc.paths) == files_a            # the rejected build left nothing
    assert leftovers(svc.paths) == []
    svc.mount_image("img")
    b = svc.build_from_dir("img", make_tree(tmp_path / "b2", variant="b"), replace=True)
    assert b.digest != a.digest and svc.get("img").digest == b.digest
    # the replaced layers stay a grace period (a create that resolved the old digest still
    # mounts it: issue 24), then the next gc unmounts and deletes them
    assert svc.mount_image(a) and svc.mounts.is_mounted(a.layers[0].digest)
    monkeypatch.setattr(store, "REPLACED_GRACE_S", 0.0)
    svc.gc()
    assert store_files(svc.paths) == [f"{b.layers[0].digest[7:]}.erofs"]
    assert not svc.mounts.is_mounted(a.layers[0].digest)


def test_unknown_image_not_found_names_field_and_fix(svc: ImageService, tmp_path):
    svc.build_from_dir("present", make_tree(tmp_path / "t"))
    for ref in ("nope", "sha256:" + "f" * 64):
        with pytest.raises(NotFound) as e:
            svc.get(ref)
        assert e.value.field == "image"
        assert "present" in e.value.fix and "build" in e.value.fix
        assert e.value.to_body()["error"]["code"] == "not_found"
    with pytest.raises(NotFound) as e:
        svc.remove("nope")
    assert e.value.field == "image"
    with pytest.raises(NotFound) as e:
        svc.mount_image("nope")
    with pytest.raises(InvalidArgument) as e:
        svc.build_from_dir("bad name!", tmp_path / "t")
    assert e.value.field == "name"
    with pytest.raises(InvalidArgument) as e:
        svc.build_from_dir("ok", tmp_path / "does-not-exist")
    assert e.value.field == "path"
    with pytest.raises(InvalidArgument) as e:
        svc.layer_path("md5:abc")
    assert e.value.field == "digest"


def test_remove_unmounts_and_garbage_collects(svc: ImageService, tmp_path):
    a = svc.build_from_dir("a", make_tree(tmp_path / "a", variant="a"))
    b = svc.build_from_dir("b", make_tree(tmp_path / "b", variant="b"))
    [ma] = svc.mount_image("a")
    [mb] = svc.mount_image("b")
    assert svc.remove("a") == [a.layers[0].digest]
    assert not ma.exists() and not svc.mounts.is_mounted(a.layers[0].digest)
    assert store_files(svc.paths) == [f"{b.layers[0].digest[7:]}.erofs"]
    assert svc.mounts.is_mounted(b.layers[0].digest)
    with pytest.raises(NotFound):
        svc.get("a")
    # a layer file the registry does not know (e.g. left by a crash) is swept too
    stray = _plant_layer(svc.paths, b"stray")
    assert svc.remove("b") == [b.layers[0].digest, stray]
    assert store_files(svc.paths) == []
    assert not mb.exists()
    assert svc.list() == []


def test_concurrent_ensure_mounted_threads_and_processes(svc: ImageService, tmp_path):
    info = svc.build_from_dir("tiny", make_tree(tmp_path / "t"))
    digest = info.layers[0].digest
    n = 16
    barrier = threading.Barrier(n)
    results: list = []

    def worker():
        lm = LayerMounts(svc.paths)
        barrier.wait()
        try:
            results.append(lm.ensure_mounted(digest))
        except Exception as e:  # pragma: no cover - reported below
            results.append(e)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mp = svc.mounts.mountpoint(digest)
    assert results == [mp] * n
    assert len([m for m in mountinfo() if m.mountpoint == str(mp.resolve())]) == 1

    svc.mounts.unmount(digest)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        got = pool.map(_mount_in_child, [(str(svc.paths.home), digest)] * 8)
    assert got == [str(mp)] * 8
    assert len([m for m in mountinfo() if m.mountpoint == str(mp.resolve())]) == 1


def _mount_in_child(arg):
    home, digest = arg
    return str(LayerMounts(Paths(Path(home))).ensure_mounted(digest))


def _chroot(root: Path, *cmd: str, user: str | None = None) -> subprocess.CompletedProcess:
    pre = ["chroot"] + ([f"--userspec={user}"] if user else []) + [str(root)]
    return subprocess.run(pre + list(cmd), capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"})


def test_builtin_busybox(svc: ImageService):
    info = ensure_builtin(svc, "busybox")
    assert info.layers[0].source == "builtin:busybox"
    [root] = svc.mount_image("busybox")
    assert (root / "bin" / "busybox").is_file() and os.readlink(root / "bin" / "sh") == "/bin/busybox"
    assert not list(root.rglob("python*"))
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    assert (root / "work").stat().st_uid == 1000
    for d in ("proc", "sys", "dev"):
        assert (root / d).is_dir() and not any((root / d).iterdir())
    assert "sandbox:x:1000:1000:sandbox:/work:" in (root / "etc" / "passwd").read_text()
    assert "sandbox:x:1000:" in (root / "etc" / "group").read_text()
    r = _chroot(root, "/bin/sh", "-c", "echo hi; id -u sandbox; ls /usr/bin/env")
    assert r.returncode == 0 and r.stdout.split() == ["hi", "1000", "/usr/bin/env"], r
    r = _chroot(root, "/bin/sh", "-c", "id -un; test -O /work && echo owns-work", user="1000:1000")
    assert r.stdout.split() == ["sandbox", "owns-work"], r
    # idempotent, and rebuilding gives the same digest
    assert ensure_builtin(svc, "busybox").digest == info.digest
    svc.remove("busybox")
    assert ensure_builtin(svc, "busybox").digest == info.digest
    with pytest.raises(NotFound) as e:
        ensure_builtin(svc, "alpine")
    assert e.value.field == "name" and "busybox" in e.value.fix


def test_builtin_debian_python(svc: ImageService, capsys):
    """debootstrap from the Debian mirror (~30-60 s), then a rebuild from the cache."""
    t0 = time.monotonic()
    info = ensure_builtin(svc, "debian-python")
    t_build = time.monotonic() - t0
    assert info.layers[0].source == "debootstrap:bookworm+procps,python3"
    t0 = time.monotonic()
    [root] = svc.mount_image("debian-python")
    t_mount = time.monotonic() - t0
    r = _chroot(root, "python3", "-c", "import pwd, sys; print(sys.version_info[0], pwd.getpwnam('sandbox').pw_dir)")
    assert r.returncode == 0 and r.stdout.split() == ["3", "/work"], r
    r = _chroot(root, "sh", "-c", "id; test -O /work && echo owns-work", user="1000:1000")
    assert "uid=1000(sandbox) gid=1000(sandbox)" in r.stdout and "owns-work" in r.stdout, r
    shadow = (root / "etc" / "shadow").read_text()
    assert shadow.count("\nsandbox:") == 1
    assert "nameserver" not in (root / "etc" / "resolv.conf").read_text()
    assert not list((root / "var" / "cache" / "apt" / "archives").glob("*.deb"))
    assert list((svc.paths.home / "cache").glob("debootstrap-bookworm-*.tar.*"))
    # rebuild after remove: from the cache, fast, same digest
    svc.remove("debian-python")
    t0 = time.monotonic()
    again = ensure_builtin(svc, "debian-python")
    t_rebuild = time.monotonic() - t0
    assert again.digest == info.digest
    assert t_rebuild < t_build
    assert leftovers(svc.paths) == []
    with capsys.disabled():
        print(f"\n[debian-python] size={info.size_bytes / 2**20:.1f} MiB build={t_build:.1f}s "
              f"rebuild-from-cache={t_rebuild:.1f}s mount={t_mount * 1000:.1f}ms")


def test_tarball_names_beyond_ascii_survive(svc: ImageService, tmp_path):
    """Names in UTF-8 (and one that is not UTF-8 at all) and a link to one: bsdtar under LC_ALL=C
    refused them ("Pathname can't be converted from UTF-8 to current locale"), which threw away
    the debootstrap cache of every image with such a file (code-interpreter, fncall-polyglot)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    names = [b"caf\xc3\xa9.txt", b"lat\xe9n", "日本語".encode()]
    for n in names:
        (tree / os.fsdecode(n)).write_text("x")
    os.symlink("café.txt", tree / "lnk-é")
    for fmt in ("posix", "gnu"):
        tarball = tmp_path / f"names-{fmt}.tar"
        subprocess.run(["tar", "-c", f"--format={fmt}", "-f", str(tarball), "-C", str(tree), "."], check=True)
        svc.build_from_tar(f"names-{fmt}", tarball)
        [mnt] = svc.mount_image(f"names-{fmt}")
        assert set(os.listdir(os.fsencode(mnt))) >= {*names, "lnk-é".encode()}
        assert os.readlink(mnt / "lnk-é") == "café.txt"


def test_a_builtin_image_of_another_recipe_is_built_again(paths: Paths, tmp_path):
    """A built-in name registered by an older dsec (or another recipe) is rebuilt by
    ensure_builtin (`dsec image build NAME --builtin`, install-extras), not returned as it is:
    before, a home upgraded from a dsec whose debian-python had no procps kept serving it."""
    from conftest import link_downloads

    from dsec.images import builtin
    paths.home.mkdir(parents=True, exist_ok=True)
    link_downloads(paths.home)
    paths.ensure()
    svc = ImageService(paths)
    old = svc.build_from_dir("debian-python", make_tree(tmp_path / "older"), source="dir:older-dsec")
    info = builtin.ensure_builtin(svc, "debian-python")
    assert info.digest != old.digest and info.layers[0].source.startswith("debootstrap:bookworm+")
    assert "procps" in info.layers[0].source
    assert builtin.ensure_builtin(svc, "debian-python").digest == info.digest     # current: kept
    # the recipe changes (a new revision): built again under the same name
    before = builtin.RECIPE_REVISION
    builtin.RECIPE_REVISION = before + 1
    try:
        again = builtin.ensure_builtin(svc, "debian-python")
        record = (paths.home / "builtin" / "debian-python.recipe").read_text().split()
        assert record == [builtin.recipe_fingerprint("debian-python"), again.digest]
    finally:
        builtin.RECIPE_REVISION = before
