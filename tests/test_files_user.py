"""dsec's own file API acts as the user a call names (issue 24, item 4): `user=` on read, write,
list, remove and watch of the SDK and of /v1/sandboxes/{id}/files; that user's permissions and ids
on what it creates; root only where the project's policy allows it (allow_root)."""

from __future__ import annotations

import os

import pytest

from dsec.iam import IAM
from dsec.sdk.client import Client
from dsec.types import DsecError, Forbidden


async def test_file_calls_act_as_the_named_user(client):
    sb = await client.create_container(image="busybox")
    try:
        await sb.files.write("/root/secret", b"root only", mode=0o600, user="root")
        assert await sb.files.read("/root/secret", user="root") == b"root only"
        assert "secret" in [e.name for e in await sb.files.list("/root", user="root")]
        with pytest.raises(DsecError) as ei:
            await sb.files.read("/root/secret")                       # the sandbox's user (1000)
        assert "Permission denied" in ei.value.message and ei.value.field == "path"
        await sb.files.write("/tmp/ids", b"n", user="4242:4343")
        await sb.files.write("/tmp/default", b"d")
        r = await sb.run("stat -c %u:%g:%a /root/secret /tmp/ids /tmp/default", user="root")
        assert r.stdout == "0:0:600\n4242:4343:644\n1000:1000:644\n", r
        with pytest.raises(DsecError):
            await sb.files.remove("/tmp/ids", user="sandbox")             # sticky /tmp: not its file
        await sb.files.remove("/tmp/ids", user="4242")
        await sb.files.remove("/root/secret", user="root")
        assert "secret" not in [e.name for e in await sb.files.list("/root", user="root")]
        with pytest.raises(DsecError) as ei:
            await sb.files.read("/etc/hostname", user="nobody")
        assert ei.value.status == 422 and ei.value.field == "user"
    finally:
        await sb.stop()


async def test_root_file_calls_need_allow_root(server):
    with IAM(server.paths.iam_db) as iam:
        project = iam.create_project(f"files-noroot-{os.urandom(3).hex()}", iam.root().id)
        key = iam.create_key(project.id)
    async with server.client() as admin, Client(server.url, key) as c:
        await admin.set_policy(project.id, {"allow_root": False})
        sb = await c.create_container(image="busybox")
        try:
            await sb.files.write("/tmp/mine", b"ok", user="sandbox")
            for call in (sb.files.read("/tmp/mine", user="root"), sb.files.write("/tmp/x", b"x", user="0:0"),
                         sb.files.list("/tmp", user="root"), sb.files.remove("/tmp/mine", user="root")):
                with pytest.raises(Forbidden) as ei:
                    await call
                assert ei.value.field == "user" and "allow_root" in ei.value.message
            assert await sb.files.read("/tmp/mine") == b"ok"
        finally:
            await sb.stop()
