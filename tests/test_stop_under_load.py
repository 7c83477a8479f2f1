"""Stops lost under load (issue 22, item 7): 3,200 sandboxes stopped 64 at a time through the
async SDK once lost 1-2 `stop()`s to `httpx.ReadError` (a kept-alive connection the server was
closing got reused: uvicorn's 5 s keep-alive equalled httpx's pool expiry), and those stayed
running. The server keeps connections 75 s now and the SDK sends GET/DELETE (and keyed creates)
again on a lost connection. 1,000 sandboxes, 64 stops in flight, 3 rounds: 0 left running."""

from __future__ import annotations

import asyncio

from dsec.types import ContainerArgs

N, IN_FLIGHT, ROUNDS = 1000, 64, 3


async def test_stops_in_bursts_leave_nothing_running(server):
    args = ContainerArgs(image="busybox", cpu_cores=0.05, memory_mb=48, labels={"test": "stop-load"})
    async with server.client() as c:
        for rnd in range(ROUNDS):
            made = [x async for x in c.create_many(N, args, concurrency=32)]
            failed = [x.error for x in made if x.sandbox is None]
            assert not failed, (rnd, failed[:3])
            sem = asyncio.Semaphore(IN_FLIGHT)

            async def stop(sb) -> BaseException | None:
                async with sem:
                    try:
                        await sb.stop()
                        return None
                    except BaseException as e:      # collected: every stop is accounted for
                        return e
            errors = [e for e in await asyncio.gather(*(stop(x.sandbox) for x in made)) if e is not None]
            assert not errors, (rnd, [repr(e) for e in errors[:3]])
            await asyncio.sleep(6)                  # past httpx's 5 s pool expiry: kept connections age
            left = [s for s in await c.list() if s.labels.get("test") == "stop-load"
                    and s.state.value in ("creating", "running", "suspended", "stopping")]
            assert not left, (rnd, len(left))


async def test_a_kept_connection_the_server_dropped_is_retried(dsec_home, images, tmp_path_factory):
    """The same failure made certain: the client holds a kept-alive connection, the server goes
    away and comes back (kill -9, start again on its port). The next stop() and get() on the
    pooled connection met ReadError / RemoteProtocolError and raised; now they are sent again."""
    from conftest import ServerProc, side_home
    srv = ServerProc(side_home(dsec_home, tmp_path_factory, "retry"))
    srv.start()
    try:
        async with srv.client() as c:
            a = await c.create_container(image="busybox")
            b = await c.create_container(image="busybox")
            await c.get(a.id)                       # the pool now holds a kept-alive connection
            srv.kill()
            srv.start()
            assert (await c.get(a.id)).info.state.value == "running"
            assert (await b.stop()).state.value in ("stopped", "stopping")
            assert (await a.stop()).state.value in ("stopped", "stopping")
    finally:
        srv.kill()
