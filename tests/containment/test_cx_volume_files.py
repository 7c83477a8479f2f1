"""The volume file API (volumes/files.py; /v1/volumes/{name}/file..., E2B's /volumecontent): the
edge reads and writes a volume's files as root on the host, in a directory sandboxes write to.
Links a sandbox's root plants there (to the host canary, its directory, /, up the tree) are
refused by name, never followed, for reads, writes, mkdir, listing and removal; `..` is refused;
a FIFO does not hang the edge; writes stop at the volume's size; another project's volume is
not found by name."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from conftest import stranger_key

from dsec import Client, ContainerArgs
from dsec.types import DsecError, InvalidArgument, NotFound


@pytest.fixture(scope="module")
async def planted(cx, host_canary):
    """A volume whose sandbox root left links and a FIFO in it; (volume name, sandbox)."""
    name = f"cxf-{secrets.token_hex(4)}"
    await cx.create_volume(name, size_mb=2)
    sb = await cx.create_container(ContainerArgs(image="busybox", user="root",
                                                 volumes=[{"name": name, "path": "/v"}]))
    r = await sb.run(f"ln -s {host_canary} /v/canary && ln -s {host_canary.parent} /v/hostdir && "
                     "ln -s / /v/slash && mkdir -p /v/d && ln -s ../../../../.. /v/d/up && "
                     "mkfifo /v/fifo && echo inside > /v/d/real && echo planted")
    assert r.stdout.strip() == "planted", r
    yield name, sb
    await sb.stop()
    await cx.delete_volume(name)


async def test_links_are_refused_never_followed(cx, planted, host_canary):
    name, sb = planted
    before = host_canary.read_text()
    for path in ("/canary", "/slash/etc/passwd", f"/hostdir/{host_canary.name}", "/d/up/etc/hostname",
                 f"/d/up{host_canary}"):
        with pytest.raises(InvalidArgument) as e:
            await cx.volume_read(name, path)
        assert e.value.field == "path" and "symlink" in e.value.message, (path, e.value)
    for path in ("/canary", f"/hostdir/{host_canary.name}", "/hostdir/new-file", "/slash/tmp/x", "/d/up/tmp/x"):
        with pytest.raises(InvalidArgument):
            await cx.volume_write(name, path, b"written through a link")
    for path in ("/hostdir/newdir", "/slash/newdir"):
        with pytest.raises(InvalidArgument):
            await cx.volume_mkdir(name, path, parents=True)
    with pytest.raises(InvalidArgument):
        await cx.volume_ls(name, "/slash")
    assert host_canary.read_text() == before
    assert not (host_canary.parent / "new-file").exists() and not (host_canary.parent / "newdir").exists()
    # listing shows the links as links, with their targets as written
    listed = {e.path: e for e in await cx.volume_ls(name, "/", depth=3)}
    assert listed["/canary"].type == "symlink" and listed["/canary"].target == str(host_canary)
    assert listed["/d/up"].type == "symlink" and "/d/up/etc" not in listed
    assert (await cx.volume_read(name, "/d/real")) == b"inside\n"
    with pytest.raises(InvalidArgument) as e:
        await cx.volume_read(name, "/d/../canary")
    assert "'..'" in e.value.message
    # a FIFO is refused at once (opened O_PATH, never for reading)
    with pytest.raises(InvalidArgument):
        await asyncio.wait_for(cx.volume_read(name, "/fifo"), 60)
    with pytest.raises(InvalidArgument):
        await asyncio.wait_for(cx.volume_write(name, "/fifo", b"x"), 60)


async def test_removal_takes_the_links_not_their_targets(cx, planted, host_canary):
    name, sb = planted
    await cx.volume_remove(name, "/hostdir")           # the link itself
    await cx.volume_remove(name, "/d")                 # a directory holding a link up the tree
    assert host_canary.exists() and host_canary.read_text().startswith("HOST-CANARY")
    r = await sb.run("ls -A /v")
    assert "hostdir" not in r.stdout.split() and "d" not in r.stdout.split() and "canary" in r.stdout, r
    with pytest.raises(InvalidArgument):
        await cx.volume_remove(name, "/")


async def test_writes_stop_at_the_volume_size(cx, planted):
    name, _ = planted
    with pytest.raises(DsecError) as e:
        await cx.volume_write(name, "/big", b"\0" * (3 << 20))     # the volume holds 2 MiB
    assert e.value.field == "size_mb", e.value
    assert "/big" not in [x.path for x in await cx.volume_ls(name)]


async def test_another_projects_volume_is_not_found(cx, planted, server):
    name, _ = planted
    await cx.volume_write(name, "/secret", b"project a's")
    async with Client(server.url, api_key=stranger_key(server, "cx-volume-files")) as other:
        for call in (other.volume_read(name, "/secret"), other.volume_write(name, "/x", b"x"),
                     other.volume_ls(name), other.volume_remove(name, "/secret"), other.volume_mkdir(name, "/y")):
            with pytest.raises(NotFound):
                await call
    assert await cx.volume_read(name, "/secret") == b"project a's"
