"""Volumes (dsec.volumes, backends/container/volumes.py): a sandbox reaches only its own
project's volumes, only through its mount; symlinks it leaves there resolve inside whoever
reads them, never on the host (measuring and deleting never follow them); a set-uid file it
plants there gives no other sandbox more rights (nosuid), and the host keeps the volumes in a
root-only directory."""

from __future__ import annotations

import secrets
import stat

import pytest
from conftest import stranger_key

from dsec import Client, ContainerArgs
from dsec.types import NotFound


async def test_another_projects_volume_is_not_found(cx, server):
    name = f"cx-{secrets.token_hex(4)}"
    await cx.create_volume(name, size_mb=16)
    mine = await cx.create_container(ContainerArgs(image="busybox", volumes=[{"name": name, "path": "/v"}]))
    try:
        await mine.run("echo secret-of-project-a > /v/secret")
        async with Client(server.url, api_key=stranger_key(server, "cx-volumes")) as other:
            assert name not in [v.name for v in await other.volumes()]
            with pytest.raises(NotFound):
                await other.create_container(ContainerArgs(image="busybox", volumes=[{"name": name, "path": "/v"}]))
            with pytest.raises(NotFound):
                await other.delete_volume(name)
            # the same name in its own project is its own, empty volume
            await other.create_volume(name, size_mb=16)
            theirs = await other.create_container(ContainerArgs(image="busybox",
                                                                volumes=[{"name": name, "path": "/v"}]))
            try:
                r = await theirs.run("ls -A /v; cat /v/secret")
                assert "secret-of-project-a" not in r.stdout and r.exit_code != 0, r
            finally:
                await theirs.stop()
            await other.delete_volume(name)
        assert (await mine.run("cat /v/secret")).stdout == "secret-of-project-a\n"
    finally:
        await mine.stop()
        await cx.delete_volume(name)


async def test_symlinks_and_setuid_files_stay_inside(cx, server, host_canary):
    name = f"cx-{secrets.token_hex(4)}"
    vol = await cx.create_volume(name, size_mb=16)
    mount = [{"name": name, "path": "/v"}]
    root = await cx.create_container(ContainerArgs(image="busybox", user="root", volumes=mount))
    user = await cx.create_container(ContainerArgs(image="busybox", volumes=mount))
    try:
        host_dir = server.paths.sandboxes / ".volumes"
        st = host_dir.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)     # host users cannot walk in
        r = await root.run(f"ln -s {host_canary} /v/canary && ln -s / /v/slash && ln -s .. /v/up && "
                           f"ln -s /proc/1/root /v/init-root && mkdir -p /v/d && ln -s ../../../../.. /v/d/out && "
                           "mkdir /v/bin && cp /bin/busybox /v/bin/id && chmod 4755 /v/bin/id && echo planted")
        assert r.stdout.strip() == "planted", r
        # the reader's own namespace resolves them: no host file, no other volume
        r = await user.run("cat /v/canary; ls -A /v/slash/ /v/up/ /v/d/out/ /v/..")
        assert "HOST-CANARY" not in r.stdout and "vol-" not in r.stdout, r
        assert r.stdout.count(".dsec") == 4, r          # each of them is the sandbox's own /
        r = await user.run("ls /v/init-root/ 2>&1; cat /v/init-root/etc/hostname 2>&1")
        assert "HOST-CANARY" not in r.stdout and "vol-" not in r.stdout, r
        # set-uid root planted by one sandbox's root: the other's user stays itself (nosuid)
        r = await user.run("stat -c '%u %a' /v/bin/id; /v/bin/id -u")
        assert r.stdout.split() == ["0", "4755", "1000"], r
        r = await user.run("grep ' /v ' /proc/self/mountinfo")
        assert "nosuid" in r.stdout and "nodev" in r.stdout, r
        # measuring the volume does not follow its links out (the canary's dir, /, ...)
        used = {v.name: v.used_bytes for v in await cx.volumes(usage=True)}[name]
        assert used is not None and used < 4 << 20, used
    finally:
        await root.stop()
        await user.stop()
    await cx.delete_volume(name)
    assert host_canary.exists() and host_canary.read_text().startswith("HOST-CANARY")
    assert not (server.paths.sandboxes / ".volumes" / vol.id).exists()
