"""Layer composition (base + workspace + toolkits + writable upper), named layer builds, and
pack_diff, against real sandboxes (crun over overlayfs over file-backed EROFS). No mocks."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.images.layers import copy_upper
from dsec.types import Conflict, InvalidArgument, NotFound

SANDBOX_UID = 1000


def _tree(root: Path, files: dict[str, str | None]) -> Path:
    """Write files (None = directory). /work is owned by the sandbox user, as in the bases:
    the topmost layer holding a directory decides its owner and mode in the overlay."""
    root.mkdir(parents=True)
    os.chmod(root, 0o755)
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            p.mkdir(exist_ok=True)
        else:
            p.write_text(text)
    for dirpath, dirnames, _ in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)
    if (root / "work").exists():
        for dirpath, dirnames, filenames in os.walk(root / "work"):
            os.lchown(dirpath, SANDBOX_UID, SANDBOX_UID)
            for n in filenames:
                os.lchown(os.path.join(dirpath, n), SANDBOX_UID, SANDBOX_UID)
    return root


@pytest.fixture(scope="module")
def layers(images, tmp_path_factory):
    """ws@1, tk-a@1, tk-b@1 registered in the server's home."""
    tmp = tmp_path_factory.mktemp("layers")
    images.build_layer("ws@1", from_dir=_tree(tmp / "ws", {
        "work/f.txt": "ws\n", "work/shared": "ws\n", "work/dir/a": "a\n", "work/dir/b": "b\n",
        "work/gone": "delete me\n", "work/rmdir/x": "x\n", "opt/ws-only": "w\n"}))
    images.build_layer("tk-a@1", from_dir=_tree(tmp / "a", {"work/shared": "a\n", "opt/a": "a\n"}))
    images.build_layer("tk-b@1", from_dir=_tree(tmp / "b", {"work/shared": "b\n", "opt/b": "b\n"}))
    return images


async def _sh(sb, cmd: str) -> str:
    r = await sb.run(cmd, user="root")
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


async def test_composition_order_merge_and_writes_land_in_upper(client, layers, server):
    async with await client.create_container(image="busybox", workspace="ws@1",
                                             toolkits=["tk-a@1", "tk-b@1"]) as sb:
        assert await _sh(sb, "cat /work/shared") == "b\n"          # last toolkit is topmost
        assert sorted((await _sh(sb, "ls /opt")).split()) == ["a", "b", "ws-only"]   # dirs merge
        assert await _sh(sb, "cat /work/f.txt") == "ws\n"
        assert "sandbox" in await _sh(sb, "cat /etc/passwd")       # base below
        # the default (non-root) user can still write in /work: the layers keep its owner
        r = await sb.run("echo mine > /work/new.txt && echo changed > /work/shared && id -u")
        assert r.exit_code == 0 and r.stdout.strip() == "1000", r.stderr
        upper = server.paths.sandboxes / sb.id / "upper"
        assert (upper / "work" / "new.txt").read_text() == "mine\n"
        assert (upper / "work" / "shared").read_text() == "changed\n"
        # the layers themselves are untouched (read-only EROFS)
        tk_b = layers.mount_image("tk-b@1")[-1]
        assert (tk_b / "work" / "shared").read_text() == "b\n"
        assert await _sh(sb, "touch /opt/b 2>&1; cat /opt/b") == "b\n"
    async with await client.create_container(image="busybox", workspace="ws@1",
                                             toolkits=["tk-b@1", "tk-a@1"]) as sb:
        assert await _sh(sb, "cat /work/shared") == "a\n"
    async with await client.create_container(image="busybox", toolkits=["tk-a@1"]) as sb:
        assert await _sh(sb, "cat /work/shared; ls /opt") == "a\na\n"   # no workspace


async def test_unknown_layers_are_404_naming_the_field(client, layers):
    with pytest.raises(NotFound) as e:
        await client.create_container(image="busybox", workspace="nope@1")
    assert e.value.field == "workspace" and "nope@1" in e.value.message
    with pytest.raises(NotFound) as e:
        await client.create_container(image="busybox", workspace="ws@1", toolkits=["tk-a@1", "nope@2"])
    assert e.value.field == "toolkits[1]" and "nope@2" in e.value.message
    with pytest.raises(NotFound) as e:
        await client.create_container(image="nope-image", workspace="ws@1")
    assert e.value.field == "image"


async def test_pack_diff_round_trip_with_deletions_and_scrub(client, layers):
    async with await client.create_container(image="busybox", workspace="ws@1", user="root") as sb:
        await _sh(sb, "echo added > /work/added && echo modified > /work/f.txt && rm /work/gone"
                      " && rm -rf /work/dir && mkdir /work/dir && echo c > /work/dir/c"
                      " && rm /etc/hosts && rm -rf /work/rmdir"
                      " && mkdir -p /root/.cache /work/.cache && echo x > /root/.cache/x"
                      " && echo y > /work/.cache/y && echo t > /tmp/junk && echo h > /root/.ash_history"
                      " && echo s > /work/secret.key && mkdir -p /work/keep && ln /work/added /work/keep/hl")
        info = await sb.pack_diff("snap@1")
        assert info.kind == "layer" and info.name == "snap@1"
        ws = layers.get("ws@1")
        assert [lay.digest for lay in info.layers[:-1]] == [lay.digest for lay in ws.layers]
        assert info.layers[-1].source.startswith(f"pack_diff:{sb.id}")
        # same content again: same digest, no conflict; a custom scrub list changes it
        assert (await sb.pack_diff("snap@1")).digest == info.digest
        custom = await sb.pack_diff("snap-custom@1", scrub=["/work/secret.key"])
        assert custom.digest != info.digest     # another scrub list packs another layer
        # changed afterwards and packed under the same name: 409, replace=True moves it
        await _sh(sb, "echo later > /work/later")
        with pytest.raises(Conflict) as e:
            await sb.pack_diff("snap@1")
        assert e.value.field == "name"
    assert (await client.images())   # registry readable through the API

    async with await client.create_container(image="busybox", workspace="snap@1", user="root") as sb2:
        assert await _sh(sb2, "cat /work/added /work/f.txt") == "added\nmodified\n"
        assert await _sh(sb2, "ls /work/dir") == "c\n"                     # replaced dir (opaque)
        r = await sb2.run("ls /work/gone /work/rmdir /etc/hosts", user="root")     # whiteouts
        assert r.exit_code != 0 and r.stdout == ""
        assert await _sh(sb2, "cat /work/shared") == "ws\n"                 # untouched below
        assert await _sh(sb2, "ls -A /root") == ""                          # scrubbed
        assert await _sh(sb2, "ls -A /tmp") == ""
        assert await _sh(sb2, "test ! -e /work/.cache/y && echo ok") == "ok\n"
        assert await _sh(sb2, "cat /work/secret.key") == "s\n"             # not in the default list
        assert await _sh(sb2, "stat -c %h /work/added") == "2\n"           # hard link kept
        assert await _sh(sb2, "test ! -e /work/later && echo ok") == "ok\n"
        # a pack of a pack stacks on it: three layers, and deletions still hold
        await _sh(sb2, "rm /work/added /work/keep/hl && echo two > /work/two")
        two = await sb2.pack_diff("snap@2")
        assert len(two.layers) == len(info.layers) + 1
    async with await client.create_container(image="busybox", workspace="snap@2", user="root") as sb3:
        assert await _sh(sb3, "cat /work/two /work/f.txt; ls /work/dir") == "two\nmodified\nc\n"
        assert (await sb3.run("ls /work/added", user="root")).exit_code != 0
    async with await client.create_container(image="busybox", workspace="snap-custom@1", user="root") as sb4:
        assert (await sb4.run("cat /work/secret.key", user="root")).exit_code != 0
        assert await _sh(sb4, "cat /work/added") == "added\n"


async def test_pack_diff_bad_input(client, layers):
    async with await client.create_container(image="busybox") as sb:
        with pytest.raises(InvalidArgument) as e:
            await client._request("POST", f"/v1/sandboxes/{sb.id}/pack_diff", json={"name": "no-version"})
        assert e.value.field == "name"
        with pytest.raises(InvalidArgument) as e:
            await client._request("POST", f"/v1/sandboxes/{sb.id}/pack_diff",
                                  json={"name": "x@1", "scrub": ["relative/path"]})
        assert e.value.field.startswith("scrub")
        # packing onto the name of a different layer: 409, and the old one is unchanged
        before = layers.get("ws@1").digest
        await _sh(sb, "echo z > /work/z")
        with pytest.raises(Conflict):
            await sb.pack_diff("ws@1")
        assert layers.get("ws@1").digest == before
    with pytest.raises(NotFound) as e:
        await client._request("POST", "/v1/sandboxes/sb-local.000000000000/pack_diff", json={"name": "x@1"})
    assert e.value.field == "sandbox_id"


def test_build_layer_sources_and_bad_input(layers, tmp_path):
    svc = layers
    store_before = sorted(p.name for p in svc.paths.store.iterdir())
    # name clash with a different digest -> Conflict naming the field; same content -> no-op
    d = _tree(tmp_path / "other", {"work/other": "o\n"})
    with pytest.raises(Conflict) as e:
        svc.build_layer("ws@1", from_dir=d)
    assert e.value.field == "name"
    with pytest.raises(InvalidArgument) as e:
        svc.build_layer("noversion", from_dir=d)
    assert e.value.field == "name"
    with pytest.raises(InvalidArgument) as e:
        svc.build_layer("x@1", from_dir=d, from_tar=d)
    assert e.value.field == "source"
    # truncated tarball: clear error, nothing registered, nothing left in the store
    tgz = tmp_path / "l.tar.gz"
    subprocess.run(["tar", "-czf", str(tgz), "-C", str(d), "."], check=True)
    raw = gzip.compress(os.urandom(200_000))
    bad = tmp_path / "trunc.tar.gz"
    full = tmp_path / "big"
    _tree(full, {"work/big": "x"})
    (full / "work" / "rand").write_bytes(raw)
    subprocess.run(["tar", "-czf", str(bad), "-C", str(full), "."], check=True)
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(InvalidArgument) as e:
        svc.build_layer("trunc@1", from_tar=bad)
    assert e.value.field == "tarball" and "truncated" in e.value.message
    with pytest.raises(NotFound):
        svc.get("trunc@1")
    assert sorted(p.name for p in svc.paths.store.iterdir()) == store_before
    assert not list((svc.paths.home / "build").glob("layer-*"))
    info = svc.build_layer("from-tar@1", from_tar=tgz)
    assert info.kind == "layer" and info.layers[0].source.startswith("tar:")


async def test_layer_from_git_checkout(client, layers, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@e"]
    (repo / "README").write_text("v1\n")
    (repo / "pkg").mkdir()
    (repo / "pkg" / "mod.py").write_text("X = 1\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    (repo / "README").write_text("v2 uncommitted\n")       # not in `git archive HEAD`
    info = layers.build_layer("repo@1", from_git=repo, prefix="work/repo", chown="1000:1000")
    assert info.layers[0].source.startswith("git:")
    async with await client.create_container(image="busybox", workspace="repo@1") as sb:
        assert (await sb.run("cat /work/repo/README /work/repo/pkg/mod.py")).stdout == "v1\nX = 1\n"
        r = await sb.run("echo edit >> /work/repo/README && stat -c %u /work/repo/README")
        assert r.exit_code == 0 and r.stdout == "1000\n", r.stderr
    with pytest.raises(InvalidArgument) as e:
        layers.build_layer("repo@2", from_git=repo, rev="no-such-rev")
    assert e.value.field == "rev"


def test_copy_upper_keeps_whiteouts_opaque_and_drops_overlay_bookkeeping(tmp_path):
    up = tmp_path / "up"
    (up / "d").mkdir(parents=True)
    os.mknod(up / "gone", 0o600 | 0o020000, os.makedev(0, 0))
    os.setxattr(up / "d", "trusted.overlay.opaque", b"y")
    os.setxattr(up / "d", "trusted.overlay.origin", b"\x00\xfb")
    os.setxattr(up / "d", "user.keep", b"1")
    (up / "tmp").mkdir()
    (up / "tmp" / "x").write_text("x")
    out = tmp_path / "out"
    copy_upper(up, out, ["/tmp"])
    st = os.lstat(out / "gone")
    assert (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0
    assert os.getxattr(out / "d", "trusted.overlay.opaque") == b"y"
    assert os.getxattr(out / "d", "user.keep") == b"1"
    assert "trusted.overlay.origin" not in os.listxattr(out / "d")
    assert not (out / "tmp").exists()


def test_cli_layer_commands(layers, tmp_path, server):
    env = {**os.environ, "DSEC_HOME": str(server.home)}
    d = _tree(tmp_path / "cli", {"work/cli": "c\n"})

    def dsec(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dsec", *args], env=env, capture_output=True,
                              text=True, timeout=120)

    r = dsec("layer", "build", "cli@1", "--from-dir", str(d))
    assert r.returncode == 0, r.stderr
    r = dsec("layer", "ls")
    assert "cli@1" in r.stdout and "ws@1" in r.stdout and "busybox" not in r.stdout
    r = dsec("layer", "inspect", "cli@1")
    assert r.returncode == 0 and '"kind": "layer"' in r.stdout
    r = dsec("layer", "inspect", "nope@1")
    assert r.returncode == 2 and "nope@1" in r.stderr
    assert dsec("layer", "rm", "cli@1").returncode == 0
    r = dsec("image", "gc")
    assert r.returncode == 0, r.stderr
    assert dsec("layer", "inspect", "cli@1").returncode == 2
