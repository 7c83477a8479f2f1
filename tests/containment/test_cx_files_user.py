"""File calls that name a user (issue 24, item 4) and E2B's user layout (item 3), attacked from a
sandbox whose default user is uid 1000: a file call as root stays inside the sandbox (no /proc
magic link, nothing in /.dsec, no host path); an unknown user is refused naming it; an image whose
/etc/passwd is a symlink planted to reach out is left alone by the E2B layout (the host's
/etc/passwd is checked byte for byte by node_intact)."""

from __future__ import annotations

import secrets
import subprocess

import pytest
from conftest import stranger_key
from oci_util import member, tar_of, write_oci

from containment._util import sh
from dsec.images.builtin import make_busybox_rootfs
from dsec.sdk.client import Client
from dsec.types import DsecError, NotFound


@pytest.fixture
async def sb(cx):
    s = await cx.create_container(image="busybox", labels={"role": "files-user"})
    yield s
    await s.stop()


async def test_root_file_calls_stay_in_the_sandbox(sb, server, host_canary):
    """As root by the call's `user`: symlinks to the agent's /proc/1 magic links, into /.dsec
    and to host paths resolve inside the sandbox or are refused; nothing of the host is read."""
    init_log = server.paths.sandboxes / sb.id / "run" / "init.log"
    secret = "HOST-INIT-LOG-" + secrets.token_hex(8)
    with open(init_log, "a") as f:
        f.write(secret + "\n")
    r = await sh(sb, "cd /work && ln -s /proc/1/fd/2 err && ln -s /proc/1/root/.. up && ln -s /.dsec dsec "
                     f"&& ln -s {host_canary} canary && echo ok")
    assert r.stdout == "ok\n", r
    for path in ("/work/err", "/proc/1/fd/1", "/work/up/etc/passwd", "/proc/1/root/etc/passwd"):
        try:
            data = await sb.files.read(path, user="root")
        except DsecError:
            continue
        assert secret.encode() not in data and b"HOST-CANARY" not in data, path
    with pytest.raises(NotFound):
        await sb.files.read("/work/canary", user="root")
    for path in ("/work/dsec/agent", "/work/dsec/evil", "/.dsec/evil"):
        with pytest.raises(DsecError) as ei:
            await sb.files.write(path, b"x", user="root")
        assert ei.value.status == 422 and "/.dsec is off limits" in ei.value.message, (path, ei.value)
    # a write replaces the link by a new file (rename), never writes through it
    await sb.files.write("/work/err", b"into the host log", user="root")
    assert "into the host log" not in init_log.read_text()
    assert (await sh(sb, "test -L /work/err || stat -c %u:%s /work/err")).stdout == "0:17\n"
    # what root may do inside, it does, with root's ids
    await sb.files.write("/root/as-root", b"r", user="root")
    r = await sh(sb, "stat -c %u:%g /root/as-root 2>&1; cat /root/as-root 2>&1 | head -c 40")
    assert r.stdout.startswith("0:0\n"), r


async def test_an_unknown_user_is_refused_naming_it(sb):
    for call in (lambda: sb.files.read("/etc/hostname", user="nobody-here"),
                 lambda: sb.files.write("/tmp/x", b"x", user="nobody-here"),
                 lambda: sb.files.list("/tmp", user="nobody-here"),
                 lambda: sb.files.remove("/tmp/x", user="nobody-here")):
        with pytest.raises(DsecError) as ei:
            await call()
        assert ei.value.status == 422 and ei.value.field == "user", ei.value


@pytest.fixture(scope="module")
def base_layer(tmp_path_factory) -> bytes:
    tmp = tmp_path_factory.mktemp("cx-users-base")
    make_busybox_rootfs(tmp / "rootfs")
    tar = tmp / "base.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(tmp / "rootfs"), "--numeric-owner", "."], check=True)
    return tar.read_bytes()


async def _image(client: Client, name: str, layers: list[bytes], tmp) -> str:
    await client.import_image(name, oci=write_oci(tmp / f"{name}-oci", layers, gz=False))
    return name


def test_e2b_layout_leaves_a_planted_passwd_symlink_alone(server, e2b_env, base_layer, tmp_path):
    """/etc/passwd and /etc/group of the image are symlinks (one to the agent's /proc/1/root, one
    to a host path): the sandbox is created, the links are neither followed nor replaced, and
    the host's files are unchanged (node_intact). An image without uid 1000 gets `user` added."""
    import asyncio

    from e2b import Sandbox
    key = stranger_key(server, "cx-users")
    links = tar_of(member("etc/passwd", "symlink", link="/proc/1/root/etc/passwd"),
                   member("etc/group", "symlink", link="/etc/../../../../etc/group"))
    no_1000 = tar_of(member("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n"),
                     member("etc/group", data=b"root:x:0:\n"))

    async def images() -> None:
        async with Client(server.url, api_key=key) as c:
            await _image(c, "cx-passwd-link", [base_layer, links], tmp_path)
            await _image(c, "cx-no-1000", [base_layer, no_1000], tmp_path)
    asyncio.run(images())
    s = Sandbox.create("cx-passwd-link", timeout=120, api_key=key)
    try:
        r = s.commands.run("readlink /etc/passwd; readlink /etc/group; id -u", user="root")
        assert r.stdout == "/proc/1/root/etc/passwd\n/etc/../../../../etc/group\n0\n", r
        assert s.commands.run("id -u; pwd").stdout == "1000\n/home/user\n"
    finally:
        s.kill()
    s = Sandbox.create("cx-no-1000", timeout=120, api_key=key)
    try:
        r = s.commands.run("whoami; cat /etc/passwd /etc/group; stat -c %u:%g /home/user")
        assert r.stdout == ("user\nroot:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n"
                            "root:x:0:\nuser:x:1000:\n1000:1000\n"), r
    finally:
        s.kill()
