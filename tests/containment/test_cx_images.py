"""Attacks through image import (issue 22, item 1): a tenant key uploads OCI layouts and
`docker save` archives whose layers try to reach the host while dsec unpacks them as root.

Each layer is applied with chroot semantics (images/unpack.py: bsdtar chrooted into the image
root), so a symlink an earlier layer left resolves inside the image, never on the host; the
explicit rules for what a layer may hold (devices, setuid bits, xattrs, '..' and absolute
names, whiteouts through links) are each checked here."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
from pathlib import Path

import httpx
import pytest
from conftest import stranger_key
from oci_util import member, tar_of, write_docker_archive, write_oci

from dsec.images.builtin import make_busybox_rootfs
from dsec.sdk.client import Client
from dsec.types import DsecError


@pytest.fixture(scope="module")
def base_layer(tmp_path_factory) -> bytes:
    """A busybox rootfs as the first layer (sandboxes run on it)."""
    tmp = tmp_path_factory.mktemp("cx-img-base")
    make_busybox_rootfs(tmp / "rootfs")
    tar = tmp / "base.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(tmp / "rootfs"), "--numeric-owner", "."], check=True)
    return tar.read_bytes()


@pytest.fixture(scope="module")
def tenant_key(server) -> str:
    return stranger_key(server, "cx-img")


@pytest.fixture(scope="module")
async def tenant(server, tenant_key):
    async with Client(server.url, api_key=tenant_key) as c:
        yield c


async def _import(client: Client, name: str, layers: list[bytes], tmp: Path, fmt: str):
    """The image, or the DsecError the import ended with."""
    try:
        if fmt == "oci":
            return await client.import_image(name, oci=write_oci(tmp / f"{name}-oci", layers, gz=False))
        return await client.import_image(name, docker_archive=write_docker_archive(tmp / f"{name}.tar", layers))
    except DsecError as e:
        return e


@pytest.mark.parametrize("fmt", ["oci", "docker-archive"])
async def test_a_layer_symlink_does_not_steer_a_later_layer_onto_the_host(tenant, base_layer, tmp_path,
                                                                          host_canary, fmt):
    """Layer 1 `x -> /var/tmp`, layer 2 `x/NEW`, `x/VICTIM` (an existing root-owned 0600 host
    file) and `x/.wh.CANARY` (a whiteout through the link): on the old code GNU tar created
    /var/tmp/NEW as root and overwrote VICTIM, in one merge group."""
    new = Path("/var/tmp") / f"dsec-cx-img-new-{secrets.token_hex(4)}"
    victim = Path("/var/tmp") / f"dsec-cx-img-victim-{secrets.token_hex(4)}"
    victim.write_text("ORIGINAL")
    victim.chmod(0o600)
    try:
        layers = [base_layer,
                  tar_of(member("x", "symlink", link="/var/tmp")),
                  tar_of(member(f"x/{new.name}", data=b"PWNED"), member(f"x/{victim.name}", data=b"PWNED"),
                         member(f"x/.wh.{host_canary.name}"))]
        got = await _import(tenant, f"cx-steer-{fmt}", layers, tmp_path, fmt)
        assert not new.exists(), f"the import created {new} on the host"
        assert victim.read_text() == "ORIGINAL" and (victim.stat().st_mode & 0o777) == 0o600
        assert host_canary.exists(), "a whiteout through the link deleted a host file"
        if isinstance(got, DsecError):
            assert got.field in ("oci", "docker_archive"), got
            assert "x" in got.message, got.message      # names the member that could not be made
    finally:
        new.unlink(missing_ok=True)
        victim.unlink(missing_ok=True)


@pytest.mark.parametrize("fmt", ["oci", "docker-archive"])
async def test_a_hard_link_through_a_layer_symlink_reads_no_host_file(server, tenant, base_layer, tmp_path,
                                                                      host_canary, fmt):
    """Layer 1 `x -> DSEC_HOME`, layer 2 a hard link `leak -> x/admin.key`: on the old code a
    sandbox of that image printed the host's admin key with `cat /leak`."""
    key_file = server.paths.admin_key_file
    links_before = key_file.stat().st_nlink
    layers = [base_layer,
              tar_of(member("x", "symlink", link=str(key_file.parent)),
                     member("c", "symlink", link=str(host_canary.parent))),
              tar_of(member("leak", "hardlink", link=f"x/{key_file.name}"),
                     member("leak2", "hardlink", link=f"c/{host_canary.name}"))]
    got = await _import(tenant, f"cx-leak-{fmt}", layers, tmp_path, fmt)
    assert key_file.stat().st_nlink == links_before and host_canary.stat().st_nlink == 1
    if isinstance(got, DsecError):
        assert "Hard-link target" in got.message and got.field in ("oci", "docker_archive"), got
        return
    async with await tenant.create_container(image=got.name) as sb:   # pragma: no cover - refused above
        out = (await sb.run("cat /leak /leak2", user="root")).stdout
        assert server.key not in out and host_canary.read_text() not in out


async def test_layers_apply_with_the_image_root_as_slash(tenant, base_layer, tmp_path):
    """Docker's semantics: a link from an earlier layer resolves inside the image (relative or
    absolute), so `lib -> usr/lib` plus `lib/foo` puts foo at /usr/lib/foo."""
    layers = [base_layer,
              tar_of(member("usr", "dir", mode=0o755), member("usr/lib", "dir", mode=0o755),
                     member("usr/lib64", "dir", mode=0o755),
                     member("lib", "symlink", link="usr/lib"), member("lib64", "symlink", link="/usr/lib64")),
              tar_of(member("lib/foo", data=b"foo\n"), member("lib64/bar", data=b"bar\n"))]
    info = await _import(tenant, "cx-chroot", layers, tmp_path, "oci")
    assert not isinstance(info, DsecError), info
    async with await tenant.create_container(image=info.name) as sb:
        r = await sb.run("cat /usr/lib/foo /usr/lib64/bar; [ -L /lib ] && [ -L /lib64 ] && echo links")
        assert r.stdout == "foo\nbar\nlinks\n", r


async def test_layer_rules_devices_setuid_xattrs_and_names(server, images, tenant, base_layer, tmp_path):
    """The explicit rules: device nodes are dropped (FIFOs kept), setuid bits and owners kept
    for inside the sandbox's user namespace while every host mount of a layer is nosuid,nodev,
    `trusted.*` xattrs (forged overlayfs metadata) dropped, absolute names made relative."""
    layers = [base_layer,
              tar_of(member("evil", "dir", mode=0o755),
                     member("evil/sda", "blk"), member("evil/mem", "chr"), member("evil/pipe", "fifo"),
                     member("evil/suid", data=b"#!/bin/sh\nid -u\n", mode=0o4755, uid=0),
                     member("evil/owned", data=b"x", uid=1234),
                     member("evil/redirect", "dir", mode=0o755,
                            xattrs={"trusted.overlay.redirect": "/etc", "user.note": "kept"}),
                     member("/evil/absolute", data=b"abs\n"))]
    info = await _import(tenant, "cx-rules", layers, tmp_path, "oci")
    assert not isinstance(info, DsecError), info
    async with await tenant.create_container(image=info.name, user="root") as sb:
        r = await sb.run("ls /evil | sort | tr '\\n' ' '; stat -c '%a %u' /evil/suid /evil/owned; cat /evil/absolute",
                         user="root")
        assert r.stdout == "absolute owned pipe redirect suid 4755 0\n644 1234\nabs\n", r
    # host side: the layer's mount is nosuid,nodev and the forged overlay xattr is gone
    dirs = await asyncio.to_thread(images.mount_image, info.name)
    top = dirs[-1]
    with pytest.raises(OSError):
        os.getxattr(top / "evil" / "redirect", "trusted.overlay.redirect")
    assert os.getxattr(top / "evil" / "redirect", "user.note") == b"kept"
    opts = {parts[1]: parts[3].split(",") for parts in
            (line.split() for line in Path("/proc/self/mounts").read_text().splitlines())}
    for d in dirs:
        assert "nosuid" in opts[str(d)] and "nodev" in opts[str(d)], (d, opts[str(d)])


async def test_dotdot_names_are_refused_naming_the_member(tenant, base_layer, tmp_path):
    got = await _import(tenant, "cx-dotdot", [base_layer, tar_of(member("a/../../escaped", data=b"x"))],
                        tmp_path, "oci")
    assert isinstance(got, DsecError) and got.field == "oci" and "a/../../escaped" in got.message, got
    assert got.fix


async def test_an_uploaded_layout_whose_files_link_out_is_refused(server, tenant_key, host_canary):
    """The OCI layout upload itself: index.json a symlink to a host file is refused, not read."""
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for ti, data in (member("oci-layout", data=b'{"imageLayoutVersion": "1.0.0"}'),
                         member("index.json", "symlink", link=str(host_canary))):
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {tenant_key}"}) as h:
        r = await h.post("/v1/images/import", params={"name": "cx-linked"}, content=buf.getvalue())
    last = json.loads(r.text.strip().splitlines()[-1])
    assert last.get("error") and "link out" in last["error"]["message"], last

