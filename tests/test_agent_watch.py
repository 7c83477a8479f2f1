"""Directory watches (WATCH/EVENT/UNWATCH): the real static agent on the host (as in
test_agent.py) watching real directories with inotify, driven through the real client."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncIterator

import pytest

from dsec.agent.build import agent_binary
from dsec.agent.client import AgentClient, AgentError, Change

from test_agent import USER, Agent, run

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="agent tests switch uids: run as root")


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory):
    return agent_binary(tmp_path_factory.mktemp("agent-bin"))


@pytest.fixture
async def agent(agent_bin):
    a = Agent(agent_bin)
    yield a
    await a.stop()


async def changes_until(stream: AsyncIterator[list[Change]], want: set[tuple[str, str]],
                        timeout: float = 10.0) -> list[Change]:
    """Changes of `stream` until every (kind, name) in `want` was seen."""
    seen: list[Change] = []

    async def collect() -> None:
        async for batch in stream:
            seen.extend(batch)
            if want <= {(c.kind, c.name) for c in seen}:
                return
    try:
        await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"missing {want - {(c.kind, c.name) for c in seen}}; got {seen}") from None
    return seen


async def test_watch_reports_create_write_chmod_rename_remove(agent):
    c = await agent.client()
    d = agent.workdir / "w"
    await run(c, 1, f"mkdir -p {d} && chown {USER}:{USER} {d}")
    stream = await c.watch(str(d), uid=USER, gid=USER)
    await run(c, 2, "echo hi > a; chmod 600 a; mv a b; rm b; mkdir sub", uid=USER, gid=USER, cwd=str(d))
    seen = await changes_until(stream, {("create", "a"), ("write", "a"), ("chmod", "a"), ("rename", "a"),
                                        ("create", "b"), ("remove", "b"), ("create", "sub")})
    assert [ch.is_dir for ch in seen if ch.name == "sub"] == [True]
    await stream.aclose()


async def test_file_write_shows_as_a_plain_write_of_the_file(agent):
    """FILE_WRITE writes a temporary sibling and renames it over the target (atomic); a watcher
    sees what a plain write would make: CREATE + WRITE of a new file, WRITE of an existing one,
    never the temporary's name. Recursive too (names below the root)."""
    c = await agent.client()
    d = agent.workdir / "fw"
    await run(c, 1, f"mkdir -p {d}/sub && chown -R {USER}:{USER} {d}")
    for recursive, sub in ((False, ""), (True, "sub/")):
        stream = await c.watch(str(d), uid=USER, gid=USER, recursive=recursive)
        await c.write_file(f"{d}/{sub}x.txt", b"one", uid=USER, gid=USER)
        await c.write_file(f"{d}/{sub}x.txt", b"two", uid=USER, gid=USER, mode=0o600)
        await c.write_file(f"{d}/{sub}empty", b"", uid=USER, gid=USER)
        await run(c, 2, f"touch {sub}marker", uid=USER, gid=USER, cwd=str(d))
        seen = await changes_until(stream, {("create", f"{sub}marker")})
        got = [(ch.kind, ch.name) for ch in seen if not ch.name.endswith("marker")]
        assert got == [("create", f"{sub}x.txt"), ("write", f"{sub}x.txt"), ("write", f"{sub}x.txt"),
                       ("create", f"{sub}empty"), ("write", f"{sub}empty")], seen
        await stream.aclose()
        assert (d / f"{sub}x.txt").read_bytes() == b"two" and (d / f"{sub}x.txt").stat().st_mode & 0o777 == 0o600


async def test_recursive_watch_follows_new_and_moved_directories(agent):
    c = await agent.client()
    d = agent.workdir / "tree"
    await run(c, 1, f"mkdir -p {d}/x/y {d}/../outside/z && chown -R {USER}:{USER} {d} {d}/../outside")
    stream = await c.watch(str(d), uid=USER, gid=USER, recursive=True)
    # existing depth, a directory created after the watch started, and one moved in from outside
    await run(c, 2, "touch x/y/deep; mkdir -p new/inner; touch new/inner/f; mv ../outside/z moved; touch moved/g",
              uid=USER, gid=USER, cwd=str(d))
    await changes_until(stream, {("create", "x/y/deep"), ("create", "new"), ("create", "new/inner/f"),
                                 ("create", "moved"), ("create", "moved/g")})
    # a directory moved out is no longer followed
    await run(c, 3, "mv moved ../gone && touch ../gone/later && touch marker", uid=USER, gid=USER, cwd=str(d))
    seen = await changes_until(stream, {("rename", "moved"), ("create", "marker")})
    assert not [ch for ch in seen if "later" in ch.name]
    await stream.aclose()


async def test_recursive_watch_reports_what_a_new_directory_already_holds(agent):
    """A tree moved in (or made by `mkdir -p a/b && touch a/b/f` faster than the agent adds its
    watch) holds entries no inotify watch saw being made: the walk that follows it reports them."""
    c = await agent.client()
    d = agent.workdir / "arrivals"
    await run(c, 1, f"mkdir -p {d} {d}/../staged/t/u && touch {d}/../staged/t/u/f {d}/../staged/t/top "
                    f"&& chown -R {USER}:{USER} {d} {d}/../staged")
    stream = await c.watch(str(d), uid=USER, gid=USER, recursive=True)
    await run(c, 2, "mv ../staged/t t", uid=USER, gid=USER, cwd=str(d))
    seen = await changes_until(stream, {("create", "t"), ("create", "t/u"), ("create", "t/u/f"),
                                        ("create", "t/top")})
    assert [ch.is_dir for ch in seen if ch.name in ("t/u", "t/u/f")] == [True, False]
    # and what is made inside it afterwards comes from its own watch
    await run(c, 3, "touch t/u/later", uid=USER, gid=USER, cwd=str(d))
    await changes_until(stream, {("create", "t/u/later")})
    await stream.aclose()


async def test_a_huge_tree_moved_in_is_reported_up_to_a_bound_then_as_overflow(agent):
    c = await agent.client()
    d = agent.workdir / "flood"
    # 20,000 files with 40-byte names: ~1 MiB of reports, beyond the agent's 256 KiB per read
    await run(c, 1, f"mkdir -p {d} {d}/../pile/p && cd {d}/../pile/p && seq -f 'file-%035g' 0 19999 | xargs touch")
    stream = await c.watch(str(d), uid=0, gid=0, recursive=True)
    await run(c, 2, "mv ../pile/p p", cwd=str(d))
    seen = await changes_until(stream, {("create", "p"), ("overflow", "")}, timeout=30)
    assert 1000 < len(seen) < 20000
    await run(c, 3, "touch p/after", cwd=str(d))          # the watch goes on
    await changes_until(stream, {("create", "p/after")})
    await stream.aclose()


async def test_non_recursive_watch_ignores_subdirectories(agent):
    c = await agent.client()
    d = agent.workdir / "flat"
    await run(c, 1, f"mkdir -p {d}/sub && chown -R {USER}:{USER} {d}")
    stream = await c.watch(str(d), uid=USER, gid=USER)
    await run(c, 2, "touch sub/inner; touch top", uid=USER, gid=USER, cwd=str(d))
    seen = await changes_until(stream, {("create", "top")})
    assert not [ch for ch in seen if ch.name.startswith("sub/")]
    await stream.aclose()


async def test_watch_is_as_the_user_and_refuses_kernel_and_agent_trees(agent):
    c = await agent.client()
    private = agent.workdir / "private"
    await run(c, 1, f"mkdir -p {private} && chmod 700 {private}")
    with pytest.raises(AgentError) as e:
        await c.watch(str(private), uid=USER, gid=USER)
    assert e.value.errno == errno.EACCES
    for path in ("/proc", "/sys/kernel", "/dev"):
        with pytest.raises(AgentError) as e:
            await c.watch(path, uid=0, gid=0)
        assert e.value.errno == errno.EPERM, path
        assert "off limits" in e.value.message
    with pytest.raises(AgentError) as e:     # through a magic link: refused, not resolved
        await c.watch(f"/proc/{agent.pid}/root/tmp", uid=0, gid=0)
    assert e.value.errno == errno.ELOOP
    with pytest.raises(AgentError) as e:
        await c.watch(str(agent.workdir / "missing"), uid=0, gid=0)
    assert e.value.errno == errno.ENOENT


async def test_recursive_watch_skips_unreadable_and_bounds_the_tree(agent):
    c = await agent.client()
    d = agent.workdir / "big"
    # 8193 directories: more than one watch follows
    await run(c, 1, f"mkdir -p {d} && cd {d} && for i in $(seq 0 8192); do echo d$i; done | xargs mkdir")
    with pytest.raises(AgentError) as e:
        await c.watch(str(d), uid=0, gid=0, recursive=True)
    assert e.value.errno == errno.E2BIG
    stream = await c.watch(str(d), uid=0, gid=0)         # the directory alone is fine
    await stream.aclose()
    # a subdirectory the user cannot read is skipped, the rest watched
    t = agent.workdir / "mixed"
    await run(c, 2, f"mkdir -p {t}/open {t}/closed && chown -R {USER}:{USER} {t} && chown root {t}/closed "
                    f"&& chmod 700 {t}/closed")
    stream = await c.watch(str(t), uid=USER, gid=USER, recursive=True)
    await run(c, 3, f"touch {t}/closed/x; touch {t}/open/y")
    seen = await changes_until(stream, {("create", "open/y")})
    assert not [ch for ch in seen if ch.name.startswith("closed/")]
    await stream.aclose()


async def test_watch_limit_unwatch_and_removal(agent):
    c = await agent.client()
    streams = []
    for i in range(16):
        d = agent.workdir / f"d{i}"
        await run(c, 100 + i, f"mkdir -p {d}")
        streams.append(await c.watch(str(d), uid=0, gid=0))
    with pytest.raises(AgentError) as e:
        await c.watch(str(agent.workdir), uid=0, gid=0)
    assert e.value.errno == errno.EAGAIN
    await streams.pop().aclose()              # UNWATCH frees a place
    extra = await c.watch(str(agent.workdir), uid=0, gid=0)
    await extra.aclose()
    # removing a watched directory ends its watch with ENOENT
    d0 = agent.workdir / "d0"
    await run(c, 200, f"rm -rf {d0}")
    with pytest.raises(AgentError) as e:
        await changes_until(streams[0], {("never", "")}, timeout=10)
    assert e.value.errno == errno.ENOENT
    fds_before = len(os.listdir(f"/proc/{agent.pid}/fd"))
    for s in streams[1:]:
        await s.aclose()
    await run(c, 201, "true")        # the agent frees closed watches before it polls again
    assert len(os.listdir(f"/proc/{agent.pid}/fd")) <= fds_before - 14


async def test_new_connection_drops_the_old_connections_watches(agent):
    c1 = await agent.client()
    for i in range(16):
        d = agent.workdir / f"c{i}"
        await run(c1, 1 + i, f"mkdir -p {d}")
        await c1.watch(str(d), uid=0, gid=0)
    c2 = await AgentClient.connect(agent.sock)      # the edge restarted: a new connection
    agent.clients.append(c2)
    stream = await c2.watch(str(agent.workdir), uid=0, gid=0)   # all 16 places are free again
    await run(c2, 1, "touch after", cwd=str(agent.workdir))
    await changes_until(stream, {("create", "after")})
    await stream.aclose()
