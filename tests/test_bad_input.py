"""Bad input gets a clear 4xx naming the field and the fix; never a 500; never a host file touched."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from dsec.types import Conflict, InvalidArgument, NotFound, Unauthorized


def _post(server, path: str, body: bytes | str, key: str | None = "use-server-key") -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {server.key if key == 'use-server-key' else key}"
    return httpx.post(server.url + path, content=body, headers=headers, timeout=30)


@pytest.mark.parametrize("body,field", [
    ('{"image": "busybox", "cpu_cores": -1}', "cpu_cores"),
    ('{"image": "busybox", "memory_mb": 99999999999}', "memory_mb"),
    ('{"image": "busybox", "ttl_idle_s": 0}', "ttl_idle_s"),
    ('{"image": "busybox", "pids_limit": 1}', "pids_limit"),
    ('{"image": "busybox", "user": "root; rm -rf /"}', "user"),
    ('{"image": "../../etc"}', "image"),
    ('{"image": "busybox", "gpu": 1}', "gpu"),
    ('{"image": "busybox", "env": {"BAD KEY": "x"}}', "env"),
    ('{"cpu_cores": 1}', "image"),
    ('{"image": "busybox", "cpu_cores": 1', "body"),     # malformed JSON
])
def test_bad_create_args_name_the_field(server, body, field):
    r = _post(server, "/v1/sandboxes", body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"].split(".")[0] == field
    assert err["message"] and err["fix"]


def test_unknown_image_is_404_naming_image(server):
    r = _post(server, "/v1/sandboxes", '{"image": "no-such-image"}')
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["field"] == "image" and "busybox" in (err["fix"] or "") + err["message"]


def test_wrong_or_missing_api_key(server):
    assert _post(server, "/v1/sandboxes", '{"image": "busybox"}', key="dsk_wrong").status_code == 401
    r = _post(server, "/v1/sandboxes", '{"image": "busybox"}', key=None)
    assert r.status_code == 401 and "DSEC_API_KEY" in r.json()["error"]["fix"]


def test_openapi_schema_served(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/sandboxes" in spec["paths"] and "/v1/sandboxes/{sandbox_id}/exec/stream" in spec["paths"]


async def test_unknown_and_malformed_sandbox_ids(client):
    with pytest.raises(NotFound) as e:
        await client.get("sb-local.000000000000")
    assert e.value.field == "sandbox_id"
    with pytest.raises(NotFound):
        await client.get("not-an-id")


async def test_command_in_stopped_sandbox(client):
    sb = await client.create_container(image="busybox")
    await sb.stop()
    with pytest.raises(Conflict) as e:
        await sb.run("true")
    assert e.value.field == "sandbox_id" and e.value.fix
    await sb.stop()   # idempotent


async def test_file_paths_cannot_reach_the_host(client, tmp_path):
    host_secret = Path("/var/tmp/dsec-host-secret.txt")
    host_secret.write_text("host-only")
    before = Path("/etc/hostname").read_bytes()
    try:
        async with await client.create_container(image="busybox", user="root") as sb:
            # traversal resolves inside the sandbox root: there is no such file in the sandbox
            with pytest.raises(NotFound) as e:
                await sb.files.read("../../../../var/tmp/dsec-host-secret.txt")
            assert e.value.field == "path"
            # an absolute symlink inside the sandbox points into the sandbox, never the host
            await sb.run("ln -s /var/tmp/dsec-host-secret.txt /work/link; ln -s /etc/hostname /work/hn")
            with pytest.raises(NotFound):
                await sb.files.read("/work/link")
            await sb.files.write("/work/hn", b"owned")          # replaces the link itself (atomic rename)
            assert (await sb.run("cat /work/hn; test -L /work/hn || echo ' regular'")).stdout == "owned regular\n"
            with pytest.raises(InvalidArgument) as e:      # /proc magic links are refused (ELOOP)
                await sb.files.write("/proc/1/root/var/tmp/dsec-host-secret.txt", b"x", mkdirs=True)
            assert e.value.field == "path" and e.value.fix
    finally:
        assert host_secret.read_text() == "host-only"
        assert Path("/etc/hostname").read_bytes() == before
        os.unlink(host_secret)


async def test_file_errors_are_clear(client):
    async with await client.create_container(image="busybox") as sb:
        with pytest.raises(NotFound):
            await sb.files.read("/work/missing.txt")
        with pytest.raises(InvalidArgument) as e:           # as uid 1000: no access to root's files
            await sb.files.write("/etc/passwd", b"x")
        assert e.value.field == "path"
        with pytest.raises(InvalidArgument):
            await sb.files.read("/work")                    # a directory
        big = os.urandom(5 * 1024 * 1024)
        await sb.files.write("big.bin", big)                # relative: inside the workdir
        assert await sb.files.read("/work/big.bin") == big


async def test_bad_exec_requests(client, server):
    async with await client.create_container(image="busybox") as sb:
        for body, field in [('{"cmd": ""}', "cmd"), ('{"cmd": "true", "timeout_s": -1}', "timeout_s"),
                            ('{"cmd": "true", "session": "../x"}', "session"), ('{"cmd": "true", "cwd": "rel"}', "cwd")]:
            r = _post(server, f"/v1/sandboxes/{sb.id}/exec", body)
            assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
        with pytest.raises(InvalidArgument):
            await sb.attach("not-a-number")


def test_unauthorized_type_for_sdk(server):
    from dsec.sdk.client import Client
    import asyncio

    async def go():
        async with Client(server.url, "dsk_nope") as c:
            with pytest.raises(Unauthorized):
                await c.list()
    asyncio.run(go())
