"""Automatic warm pools (edge/warm_auto.py, D99) on a real server: a burst of 8 creates of one
shape makes the node keep that shape warm, and the next burst claims from it; the operator's
targets win; a tenant's create that admission would refuse drops it (and is admitted); it ends
after the quiet period; a claimed sandbox is never handed out again and carries its claimer's
labels, env and limits."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import pytest

from conftest import ServerProc, side_server
from dsec.sdk.client import Client, Sandbox
from dsec.testing.waiting import wait_until
from dsec.types import WarmPools

AUTO = 8
IDLE_S = 40        # the quiet period, short for the test (default 300)
MAX_SANDBOXES = 24
START_S = 180


@pytest.fixture(scope="module")
def auto_server(images, dsec_home, tmp_path_factory):
    """A server that keeps up to 8 sandboxes warm on its own, at most 24 sandboxes in all."""
    with side_server(dsec_home, tmp_path_factory, "warmauto",
                     {"DSEC_WARM_POOL_AUTO": str(AUTO), "DSEC_WARM_POOL_AUTO_IDLE_S": str(IDLE_S),
                      "DSEC_MAX_SANDBOXES": str(MAX_SANDBOXES), "DSEC_WARM_POOL_AUTO_MARGIN_MB": "0"},
                     start_timeout_s=START_S) as srv:
        yield srv


def _crun_ids(server: ServerProc) -> set[str]:
    out = subprocess.run(["crun", "--root", str(server.paths.crun_root), "list", "-q"],
                         capture_output=True, text=True, check=False).stdout
    return set(out.split())


async def _pool_ids(server: ServerProc, c: Client) -> set[str]:
    """Containers the runtime holds that no sandbox list shows: the idle pool's."""
    live = {sb.id for sb in await c.list()}
    return _crun_ids(server) - live


async def _reset(c: Client) -> None:
    """No pool, no pause after an earlier drop; the bound as the server started."""
    await c.set_warm_pools("", auto=0)
    await c.set_warm_pools(None, auto=AUTO)
    await wait_until(lambda: _none_waiting(c), timeout_s=60, every_s=0.3, what="the pools to drain")


async def _none_waiting(c: Client) -> bool:
    st = await c.warm_pools()
    return not st.auto and not st.pools


async def _burst(c: Client, n: int, **kw) -> list[Sandbox]:
    return list(await asyncio.gather(*(c.create_container(image="busybox", **kw) for _ in range(n))))


async def _auto_full(c: Client, image: str = "busybox", size: int = AUTO) -> WarmPools | None:
    st = await c.warm_pools()
    p = st.auto.get(image)
    return st if p is not None and p.size == size and p.idle >= size and p.starting == 0 else None


async def _stop(sbs: list[Sandbox]) -> None:
    await asyncio.gather(*(sb.stop() for sb in sbs))


async def test_a_burst_makes_an_automatic_pool_and_the_next_burst_claims_it(auto_server):
    async with auto_server.client() as c:
        await _reset(c)
        first = await _burst(c, AUTO, labels={"step": "1"})
        st = await c.warm_pools()
        assert st.pools == {} and st.auto_max == AUTO, st
        assert st.auto["busybox"].size == AUTO and st.auto["busybox"].burst == AUTO, st
        await _stop(first)
        st = await wait_until(lambda: _auto_full(c), timeout_s=120, every_s=0.3, what="the automatic pool to fill")
        pooled = await _pool_ids(auto_server, c)
        assert len(pooled) == AUTO and not pooled & {sb.id for sb in first}
        # the metric shows the node's own pool apart from configured ones
        text = httpx.get(auto_server.url + "/metrics", headers={"Authorization": f"Bearer {auto_server.key}"},
                         timeout=30).text
        assert f'dsec_warm_pool_idle{{image="busybox",node="local",of="idle",pool="auto"}} {AUTO}.0' in text, \
            [line for line in text.splitlines() if line.startswith("dsec_warm_pool_idle")]
        before = st.claims
        # the next step's burst: every create claimed from the pool, each with its own settings
        second = await asyncio.gather(*(c.create_container(image="busybox", labels={"step": "2", "i": str(i)},
                                                           env={"RANK": str(i)}, memory_mb=300 + i, pids_limit=50 + i)
                                        for i in range(AUTO)))
        try:
            assert {sb.id for sb in second} == pooled
            assert (await c.warm_pools()).claims - before == AUTO
            for i, sb in enumerate(second):
                info = await sb.refresh()
                assert info.labels == {"step": "2", "i": str(i)} and info.memory_mb == 300 + i
                assert (await sb.run("echo $RANK")).stdout == f"{i}\n"
            # the claimed ones are the claimers' alone: a refill brings other containers
            await _stop(list(second))
            await wait_until(lambda: _auto_full(c), timeout_s=120, every_s=0.3, what="the pool to refill")
            again = await _pool_ids(auto_server, c)
            assert len(again) == AUTO and not again & pooled
            third = await _burst(c, AUTO)
            assert {sb.id for sb in third} == again
            await _stop(third)
        finally:
            await asyncio.gather(*(sb.stop() for sb in second), return_exceptions=True)


async def test_a_burst_of_another_shape_makes_no_pool(auto_server):
    """memory_mb 128: /dev/shm and the agent's output bound differ from a pool sandbox's, so a
    pool of the image would never answer it: none is kept."""
    async with auto_server.client() as c:
        await _reset(c)
        small = await _burst(c, AUTO, memory_mb=128)
        await _stop(small)
        await wait_until(lambda: _none_waiting(c), timeout_s=30, every_s=0.3, what="the shape found unpoolable")
        await asyncio.sleep(2)
        st = await c.warm_pools()
        assert st.auto == {} and len(await _pool_ids(auto_server, c)) == 0, st


async def test_operator_targets_win(auto_server):
    async with auto_server.client() as c:
        await _reset(c)
        await _stop(await _burst(c, AUTO))
        assert (await c.warm_pools()).auto["busybox"].size == AUTO
        try:
            st = await c.set_warm_pools("busybox:2")
            assert st.pools["busybox"].size == 2 and "busybox" not in st.auto, st

            async def two() -> bool:
                s = await c.warm_pools()
                return s.pools["busybox"].full and len(await _pool_ids(auto_server, c)) == 2
            await wait_until(two, timeout_s=120, every_s=0.3, what="the operator's pool of 2, and only it")
            await _stop(await _burst(c, AUTO))            # the burst again: the operator's size stands
            await asyncio.sleep(1)
            st = await c.warm_pools()
            assert st.pools["busybox"].size == 2 and st.auto == {}, st
        finally:
            await c.set_warm_pools("")


async def test_a_create_admission_would_refuse_drops_it_and_is_admitted(auto_server):
    """24 sandboxes at most: with 8 waiting in the automatic pool, the 17th tenant sandbox of
    another shape would be refused; the pool is dropped instead and the create admitted."""
    async with auto_server.client() as c:
        await _reset(c)
        await _stop(await _burst(c, AUTO))
        await wait_until(lambda: _auto_full(c), timeout_s=120, every_s=0.3, what="the automatic pool to fill")
        held: list[Sandbox] = []
        try:
            for _ in range(MAX_SANDBOXES - AUTO + 1):     # not the pool's shape: nothing claimed
                held.append(await c.create_container(image="busybox", memory_mb=128))
            st = await c.warm_pools()
            assert st.auto == {} and st.auto_dropped and "refused" in st.auto_dropped, st
            assert st.auto_off_s > 0

            async def gone() -> bool:
                return not await _pool_ids(auto_server, c)
            await wait_until(gone, timeout_s=60, every_s=0.3, what="the pool's sandboxes destroyed")
            # paused: the next burst makes none while the pause lasts
            await _stop(held)
            held = []
            await asyncio.sleep(3.5)       # placement's view of the node (watcher 1 s, reservations 2 s)
            await _stop(await _burst(c, AUTO))
            assert (await c.warm_pools()).auto == {}
        finally:
            await _stop(held)
            await _reset(c)


async def test_it_ends_after_the_quiet_period(auto_server):
    async with auto_server.client() as c:
        await _reset(c)
        await _stop(await _burst(c, AUTO))
        await wait_until(lambda: _auto_full(c), timeout_s=120, every_s=0.3, what="the automatic pool to fill")

        async def ended() -> bool:
            return (await c.warm_pools()).auto == {} and not await _pool_ids(auto_server, c)
        await wait_until(ended, timeout_s=IDLE_S + 60, every_s=1, what="the automatic pool to end")
