"""OCI import: an OCI layout dir and a docker-archive tarball, built by hand here (no registry
is reachable), imported with layer merging, and run as real sandboxes. Whiteouts: deleted
files, deleted dirs, replaced (opaque) dirs, a dir deleted and re-created, within one merged
EROFS layer and across EROFS layers."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys

import pytest
from oci_util import layer_tar as _tar
from oci_util import write_docker_archive as _write_docker_archive
from oci_util import write_oci as _write_oci

from dsec.images.builtin import make_busybox_rootfs
from dsec.types import Conflict, InvalidArgument, NotFound


@pytest.fixture(scope="module")
def oci_layers(tmp_path_factory) -> list[bytes]:
    """Four layer tarballs: busybox rootfs, then additions, then deletions, then re-adds."""
    tmp = tmp_path_factory.mktemp("ocisrc")
    make_busybox_rootfs(tmp / "rootfs")
    base = tmp / "base.tar"
    subprocess.run(["tar", "-cf", str(base), "-C", str(tmp / "rootfs"), "--numeric-owner", "."], check=True)
    l2 = _tar([("etc/", None), ("etc/motd", "hello\n"), ("opt/", None), ("opt/old/", None),
               ("opt/old/x", "x\n"), ("opt/old/y", "y\n"), ("srv/", None), ("srv/app/", None),
               ("srv/app/a", "a\n"), ("srv/app/b", "b\n"), ("srv/keep", "keep\n"),
               ("srv/file-then-dir", "f\n")])
    l3 = _tar([("etc/", None), ("etc/.wh.motd", ""),             # delete a file of L2
               ("srv/", None), ("srv/app/", None), ("srv/app/new", "new\n"),
               ("srv/app/.wh..wh..opq", ""),                       # after a same-layer entry
               ("opt/", None), ("opt/.wh.old", ""),                # delete a dir of L2
               ("bin/", None), ("bin/.wh.vi", ""),                 # delete a file of the base
               ("srv/.wh.file-then-dir", "")])
    l4 = _tar([("opt/", None), ("opt/old/", None), ("opt/old/z", "z\n"),   # dir re-created
               ("srv/", None), ("srv/file-then-dir/", None), ("srv/file-then-dir/in", "in\n")])
    return [base.read_bytes(), l2, l3, l4]


async def _check_content(client, image: str) -> None:
    async with await client.create_container(image=image, user="root") as sb:
        async def sh(cmd: str):
            return await sb.run(cmd, user="root")
        r = await sh("ls /etc/motd /bin/vi /srv/app/a /srv/app/b")
        assert r.exit_code != 0 and r.stdout == "", r.stdout        # deleted files
        assert (await sh("ls /srv/app")).stdout == "new\n"          # opaque: only this layer's
        assert (await sh("ls /opt/old")).stdout == "z\n"            # deleted, re-created
        assert (await sh("cat /srv/keep /srv/file-then-dir/in")).stdout == "keep\nin\n"
        assert (await sh("ls /bin/ls && cat /etc/hosts")).exit_code == 0   # base intact
        assert (await sh("echo w > /srv/app/w && cat /srv/app/w")).stdout == "w\n"


@pytest.mark.parametrize("merge_bytes,n_layers", [(1 << 40, 1), (1, 4)])
async def test_import_oci_layout_merged_and_split(client, images, oci_layers, tmp_path,
                                                  merge_bytes, n_layers):
    layout = _write_oci(tmp_path / "oci", oci_layers)
    name = f"oci-{n_layers}"
    info = images.import_oci(name, oci=layout, merge_bytes=merge_bytes)
    assert len(info.layers) == n_layers
    if n_layers == 4:
        # the split layers keep overlay semantics: a whiteout and an opaque dir in layer 3
        mnt = images.mount_image(name)
        st = os.lstat(mnt[2] / "etc" / "motd")
        assert (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0
        assert os.getxattr(mnt[2] / "srv" / "app", "trusted.overlay.opaque") == b"y"
        # re-created in its own layer: the whiteout below stops the merge, no opaque needed
        assert "trusted.overlay.opaque" not in os.listxattr(mnt[3] / "opt" / "old")
    else:
        mnt = images.mount_image(name)[0]
        assert not os.path.lexists(mnt / "etc" / "motd")     # applied, no whiteout needed
    await _check_content(client, name)


async def test_import_docker_archive_and_middle_merge(client, images, oci_layers, tmp_path):
    arc = _write_docker_archive(tmp_path / "img.tar", oci_layers)
    # merge threshold that puts the base alone and merges the three small layers
    info = images.import_oci("docker-img", docker_archive=arc, merge_bytes=64 << 10)
    assert len(info.layers) == 2
    await _check_content(client, "docker-img")
    with pytest.raises(Conflict):
        images.import_oci("docker-img", oci=_write_oci(tmp_path / "o", oci_layers[:2]))


def test_import_bad_input_leaves_nothing(images, oci_layers, tmp_path):
    store_before = sorted(p.name for p in images.paths.store.iterdir())
    layout = _write_oci(tmp_path / "oci", oci_layers)
    blobs = sorted((layout / "blobs" / "sha256").iterdir(), key=lambda p: -p.stat().st_size)
    blobs[0].write_bytes(blobs[0].read_bytes()[:1000])            # truncate the biggest layer
    with pytest.raises(InvalidArgument) as e:
        images.import_oci("bad-oci", oci=layout)
    assert e.value.field == "oci" and "digest mismatch" in e.value.message
    with pytest.raises(InvalidArgument) as e:
        images.import_oci("bad-oci", oci=tmp_path)
    assert e.value.field == "oci" and "oci-layout" in e.value.message
    arc = _write_docker_archive(tmp_path / "a.tar", oci_layers)
    trunc = tmp_path / "t.tar"
    trunc.write_bytes(arc.read_bytes()[: arc.stat().st_size // 2])
    with pytest.raises(InvalidArgument) as e:
        images.import_oci("bad-docker", docker_archive=trunc)
    assert e.value.field == "docker_archive"
    # a truncated layer inside an otherwise valid layout (digest matches the truncated bytes)
    bad = _write_oci(tmp_path / "oci2", [oci_layers[0], gzip.compress(oci_layers[1])[:300]])
    with pytest.raises(InvalidArgument) as e:
        images.import_oci("bad-layer", oci=bad, merge_bytes=1)
    assert e.value.field == "oci" and "truncated" in e.value.message
    for n in ("bad-oci", "bad-docker", "bad-layer"):
        with pytest.raises(NotFound):
            images.get(n)
    assert sorted(p.name for p in images.paths.store.iterdir()) == store_before
    assert not list((images.paths.home / "build").glob("oci-*"))


def test_cli_image_import(images, oci_layers, tmp_path, server):
    layout = _write_oci(tmp_path / "oci", oci_layers, gz=False)
    env = {**os.environ, "DSEC_HOME": str(server.home)}
    r = subprocess.run([sys.executable, "-m", "dsec", "image", "import", "cli-oci", "--oci", str(layout),
                        "--merge-mb", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(images.get("cli-oci").layers) == 2
    r = subprocess.run([sys.executable, "-m", "dsec", "image", "import", "x", "--oci", str(tmp_path / "none")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a directory" in r.stderr
