"""dsec's own directory watch (`sb.files.watch`, GET /v1/sandboxes/{id}/files/watch): the real
server, real containers and a real microVM guest, the agent's inotify inside each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from conftest import stranger_key

from dsec.types import FsEvent, InvalidArgument, NotFound


async def until(events: AsyncIterator[FsEvent], want: set[tuple[str, str]], timeout: float = 20.0) -> list[FsEvent]:
    seen: list[FsEvent] = []

    async def collect() -> None:
        async for ev in events:
            seen.append(ev)
            if want <= {(e.type, e.name) for e in seen}:
                return
    try:
        await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"missing {want - {(e.type, e.name) for e in seen}}; got {seen}") from None
    return seen


async def watched(sb, path: str, recursive: bool = False) -> AsyncIterator[FsEvent]:
    """The watch, once in place (its `start` consumed)."""
    events = sb.files.watch(path, recursive=recursive)
    first = await anext(events)
    assert first.type == "start"
    return events


async def test_container_watch_follows_changes_and_subtrees(client):
    sb = await client.create_container(image="busybox")
    try:
        await sb.run("mkdir -p /tmp/w/old")
        events = await watched(sb, "/tmp/w", recursive=True)
        await sb.files.write("/tmp/w/api.txt", "via the file API")
        await sb.run("cd /tmp/w && echo x > old/f && mkdir -p new/deeper && touch new/deeper/g && rm api.txt")
        seen = await until(events, {("create", "api.txt"), ("create", "old/f"), ("write", "old/f"),
                                    ("create", "new"), ("create", "new/deeper/g"), ("remove", "api.txt")})
        assert [e.is_dir for e in seen if e.name == "new"] == [True]
        await events.aclose()
        # the directory's removal ends a watch with NotFound
        events = await watched(sb, "/tmp/w/old")
        await sb.run("rm -rf /tmp/w/old")
        with pytest.raises(NotFound, match="removed"):
            await until(events, {("never", "")})
    finally:
        await sb.stop()


async def test_watch_refusals_and_tenancy(client, server):
    sb = await client.create_container(image="busybox")
    try:
        for path in ("/proc", "/sys", "/.dsec", "/proc/1/root/etc"):
            with pytest.raises(InvalidArgument):
                await watched(sb, path)
        with pytest.raises(NotFound):
            await watched(sb, "/no/such/dir")
        # another project's key: the sandbox looks missing, as for every other call
        r = httpx.get(f"{server.url}/v1/sandboxes/{sb.id}/files/watch", params={"path": "/tmp"},
                      headers={"authorization": f"Bearer {stranger_key(server, 'watch-other')}"})
        assert r.status_code == 404
        # 16 watches at once; a client that goes away frees its watch
        streams = [await watched(sb, "/tmp") for _ in range(16)]
        with pytest.raises(Exception, match="too many directory watches"):
            await watched(sb, "/tmp")
        for s in streams:
            await s.aclose()
        for attempt in range(50):       # the server notices the closed connections
            try:
                again = await watched(sb, "/tmp")
                break
            except Exception:
                await asyncio.sleep(0.2)
        else:
            raise AssertionError("watches of closed streams were not freed")
        await sb.run("touch /tmp/after-reuse")
        await until(again, {("create", "after-reuse")})
        await again.aclose()
    finally:
        await sb.stop()


async def test_vm_watch(vm_client):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256)
    try:
        await sb.run("mkdir -p /tmp/vw")
        events = await watched(sb, "/tmp/vw", recursive=True)
        await sb.run("cd /tmp/vw && mkdir d && echo hi > d/file && mv d/file d/moved")
        await until(events, {("create", "d"), ("create", "d/file"), ("rename", "d/file"), ("create", "d/moved")},
                    timeout=60)
        await events.aclose()
    finally:
        await sb.stop()
