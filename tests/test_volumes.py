"""Volumes: a project's named directories mounted into many sandboxes (read-write or read-only),
outliving them, with a byte quota; refused for VMs, by name. Real containers, real mounts."""

from __future__ import annotations

import secrets

import httpx
import pytest

from dsec import ContainerArgs
from dsec.types import Conflict, NotFound


def _name() -> str:
    return f"v-{secrets.token_hex(4)}"


async def test_shared_read_write_read_only_and_outliving_its_sandboxes(client, server):
    name = _name()
    vol = await client.create_volume(name, size_mb=64)
    assert vol.name == name and vol.size_mb == 64
    assert name in [v.name for v in await client.volumes()]
    rw = [{"name": name, "path": "/data"}]
    a = await client.create_container(ContainerArgs(image="busybox", volumes=rw))
    b = await client.create_container(ContainerArgs(image="busybox", volumes=rw))
    ro = await client.create_container(ContainerArgs(image="busybox", volumes=[{**rw[0], "read_only": True}]))
    try:
        r = await a.run("echo from-a > /data/f && mkdir /data/d && echo deep > /data/d/g && stat -c '%u %g' /data/f")
        assert r.exit_code == 0 and r.stdout == "1000 1000\n", r       # the sandbox user, in every sandbox
        r = await b.run("cat /data/f /data/d/g && stat -c '%u' /data/f && echo from-b >> /data/f")
        assert r.exit_code == 0 and r.stdout == "from-a\ndeep\n1000\n", r
        assert (await a.run("cat /data/f")).stdout == "from-a\nfrom-b\n"
        # on the host the file keeps the in-sandbox ids (each sandbox's own range is an idmapped
        # mount over it, never a chown)
        st = (server.paths.sandboxes / ".volumes" / vol.id / "f").stat()
        assert (st.st_uid, st.st_gid) == (1000, 1000)
        r = await ro.run("cat /data/f; echo x > /data/new")
        assert r.stdout == "from-a\nfrom-b\n" and r.exit_code != 0 and "Read-only" in r.stderr, r
        with pytest.raises(Conflict, match="mounted by"):
            await client.delete_volume(name)                   # in use: refused, nothing lost
    finally:
        for s in (a, b, ro):
            await s.stop()
    c = await client.create_container(ContainerArgs(image="busybox", volumes=rw))
    try:
        assert (await c.run("cat /data/f")).stdout == "from-a\nfrom-b\n"    # outlived a, b
        # parked (to disk when nothing runs: torn down to its files) and started again: mounted again
        assert (await c.suspend()).state.value == "suspended"
        r = await c.run("echo after-park >> /data/f && tail -n1 /data/f && grep ' /data ' /proc/self/mountinfo")
        assert r.stdout.startswith("after-park\n") and "idmapped" in r.stdout and "nosuid" in r.stdout, r
        with pytest.raises(Conflict):
            await client.delete_volume(name)
    finally:
        await c.stop()
    await client.delete_volume(name)
    assert name not in [v.name for v in await client.volumes()]
    with pytest.raises(NotFound, match=name) as e:
        await client.create_container(ContainerArgs(image="busybox", volumes=rw))
    assert e.value.field == "volumes[0].name"


async def test_quota_on_bytes(client):
    name = _name()
    vol = await client.create_volume(name, size_mb=8)
    sb = await client.create_container(ContainerArgs(image="busybox", volumes=[{"name": name, "path": "/q"}]))
    try:
        r = await sb.run("dd if=/dev/zero of=/q/big bs=1M count=24 2>&1; sync")
        if vol.enforced:                     # btrfs qgroup: the kernel refuses the write
            assert "quota" in r.stdout.lower(), r
            print("quota enforced by the kernel")
        else:                                # measured: the next read-write mount is refused
            assert r.exit_code == 0
    finally:
        await sb.stop()
    used = {v.name: v.used_bytes for v in await client.volumes(usage=True)}[name]
    assert used is not None and used > 0
    if not vol.enforced:
        with pytest.raises(Exception, match="size_mb"):
            await client.create_container(ContainerArgs(image="busybox", volumes=[{"name": name, "path": "/q"}]))
    else:
        assert used <= (8 << 20) + (1 << 20)
    await client.delete_volume(name)


async def test_bad_mounts_and_vms_are_refused_by_name(client, server):
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"},
                                 timeout=60) as h:
        for body, field in (({"backend": "microvm", "image": "busybox", "volumes": [{"name": "x", "path": "/x"}]},
                             "volumes"),
                            ({"image": "busybox", "volumes": [{"name": "x", "path": "/proc/x"}]}, "path"),
                            ({"image": "busybox", "volumes": [{"name": "x", "path": "/a"}, {"name": "y", "path": "/a/b"}]},
                             "overlap")):
            r = await h.post("/v1/sandboxes", json=body)
            assert r.status_code in (400, 422) and field in r.text, r.text
        r = await h.post("/v1/volumes", json={"name": "Bad Name"})
        assert r.status_code in (400, 422) and "name" in r.text
        name = _name()
        assert (await h.post("/v1/volumes", json={"name": name})).status_code == 201
        r = await h.post("/v1/volumes", json={"name": name})
        assert r.status_code == 409 and "already" in r.text
        assert (await h.delete(f"/v1/volumes/{name}")).status_code == 204
        assert (await h.delete(f"/v1/volumes/{name}")).status_code == 404


def test_cli_volume_create_ls_rm_and_sandbox_create_volume(server, tmp_path):
    import subprocess
    import sys

    def dsec(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([sys.executable, "-m", "dsec", *args], env={**server.env, "DSEC_API_KEY": server.key,
                                                                      "COLUMNS": "200"},
                           capture_output=True, text=True, timeout=120)
        assert (p.returncode == 0) == ok, p.stdout + p.stderr
        return p
    name = _name()
    assert f"created volume {name}" in dsec("volume", "create", name, "--size-mb", "32").stdout
    assert name in dsec("volume", "ls", "--usage").stdout
    sid = dsec("sandbox", "create", "busybox", "--volume", f"{name}:/v:ro").stdout.strip()
    try:
        p = dsec("sandbox", "exec", sid, "--", "sh", "-c", "grep ' /v ' /proc/self/mountinfo", ok=True)
        assert " ro," in p.stdout or p.stdout.split()[5].startswith("ro"), p.stdout
        p = dsec("volume", "rm", name, ok=False)
        assert "mounted by" in p.stdout + p.stderr
    finally:
        dsec("sandbox", "rm", sid)
    # files without a sandbox: cp in and out (stdin/stdout too), list, remove
    src = tmp_path / "in.txt"
    src.write_text("from the cli\n")
    assert "wrote 13 bytes" in dsec("volume", "cp", str(src), f"{name}:/d/in.txt").stdout
    assert dsec("volume", "cp", f"{name}:/d/in.txt", "-").stdout == "from the cli\n"
    listed = dsec("volume", "files", name, "--depth", "2").stdout
    assert "/d/in.txt" in listed and "1000:1000" in listed, listed
    dsec("volume", "rm-file", f"{name}:/d")
    assert "/d" not in dsec("volume", "files", name).stdout
    assert "VOLUME:/path" in dsec("volume", "cp", str(src), str(src), ok=False).stderr
    dsec("volume", "rm", name)
    assert name not in dsec("volume", "ls").stdout


async def test_volumes_outside_the_scratch_are_measured_at_mount(dsec_home, images, tmp_path_factory):
    """DSEC_VOLUMES_DIR (a cluster's shared store): plain directories, no kernel quota; a volume
    over its size is refused at its next read-write mount, and can still be mounted read-only."""
    from conftest import LOCAL_DNS_SINK, side_server
    store = tmp_path_factory.mktemp("shared-volumes")
    with side_server(dsec_home, tmp_path_factory, "volumes-dir",
                     {"DSEC_NET_DNS_UPSTREAM": LOCAL_DNS_SINK, "DSEC_VOLUMES_DIR": str(store)}) as srv:
        async with srv.client() as c:
            vol = await c.create_volume("small", size_mb=1)
            assert not vol.enforced and (store / f"{vol.id}.json").exists()
            sb = await c.create_container(ContainerArgs(image="busybox", volumes=[{"name": "small", "path": "/s"}]))
            try:
                r = await sb.run("dd if=/dev/zero of=/s/big bs=1M count=3 2>&1 && sync && stat -c %u /s/big")
                assert r.exit_code == 0 and r.stdout.endswith("1000\n"), r     # not enforced while mounted
            finally:
                await sb.stop()
            with pytest.raises(Exception, match="size_mb=1") as e:
                await c.create_container(ContainerArgs(image="busybox", volumes=[{"name": "small", "path": "/s"}]))
            assert getattr(e.value, "field", None) == "volumes[0]"
            ro = await c.create_container(ContainerArgs(image="busybox",
                                                        volumes=[{"name": "small", "path": "/s", "read_only": True}]))
            try:
                assert (await ro.run("ls /s")).stdout == "big\n"
            finally:
                await ro.stop()
            # the volume file API checks the measured size before a write (no kernel quota here)
            with pytest.raises(Exception, match="size_mb") as e:
                await c.volume_write("small", "/more", b"x" * 1024)
            assert getattr(e.value, "field", None) == "size_mb"
            await c.volume_remove("small", "/big")
            assert (await c.volume_write("small", "/more", b"x" * 1024)).size == 1024
            await c.delete_volume("small")
            assert not (store / vol.id).exists()
