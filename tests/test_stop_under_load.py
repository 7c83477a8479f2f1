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


async def test_requests_ride_through_a_server_that_drops_their_connection(dsec_home, images, tmp_path_factory):
    """The same failure made certain: requests in flight when the server goes away (it is
    stopped with the requests in its socket, killed, and started again on its port). get() and
    stop() met ReadError / RemoteProtocolError (then ConnectError while it restarts) and raised;
    now they are sent again until the server is back, and each acts once."""
    import os
    import signal

    from conftest import side_server
    with side_server(dsec_home, tmp_path_factory, "retry") as srv:
        async with srv.client() as c:
            a = await c.create_container(image="busybox")
            b = await c.create_container(image="busybox")
            assert (await c.get(a.id)).info.state.value == "running"     # a kept-alive connection
            assert srv.proc is not None
            os.kill(srv.proc.pid, signal.SIGSTOP)
            pending = [asyncio.create_task(c.get(a.id)), asyncio.create_task(b.stop())]
            await asyncio.sleep(1)                   # both sent, neither answered
            assert not any(t.done() for t in pending)
            srv.kill()                               # the connections are reset
            srv.start()
            got, stopped = await asyncio.gather(*pending)
            assert got.info.state.value == "running"
            assert stopped.state.value in ("stopped", "stopping")
            assert (await c.get(b.id)).info.state.value in ("stopped", "stopping")
            await a.stop()


async def test_an_exec_whose_answer_is_lost_is_resent_and_runs_once(server):
    """run() and start() carry an idempotency key the SDK made (none was given): when the
    connection drops after the server ran the command but before its answer arrived, the SDK
    sends the request again and gets the first run's result; the command ran once. Before, the
    request raised (an exec was resent only when the connection could not be made)."""
    from dsec.sdk.client import Client
    dropped: list[bytes] = []

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        """Forward both ways; the answer to the first two exec requests is dropped (the client's
        connection aborted as the server starts answering: the command has run)."""
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", server.port)
        drop: list[bytes] = []

        async def up() -> None:
            while data := await c_reader.read(65536):
                line = data.split(b"\r\n", 1)[0]
                if line.startswith(b"POST ") and b"/exec" in line and len(dropped) + len(drop) < 2:
                    drop.append(line)
                s_writer.write(data)
                await s_writer.drain()

        async def down() -> None:
            while data := await s_reader.read(65536):
                if drop:
                    dropped.append(drop.pop())
                    c_writer.transport.abort()
                    return
                c_writer.write(data)
                await c_writer.drain()

        try:
            await asyncio.wait([asyncio.create_task(up()), asyncio.create_task(down())],
                               return_when=asyncio.FIRST_COMPLETED)
        except (ConnectionError, OSError):
            pass
        finally:
            c_writer.transport.abort()
            s_writer.close()

    proxy = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = proxy.sockets[0].getsockname()[1]
    try:
        async with server.client() as direct:
            sb = await direct.create_container(image="busybox")
            try:
                async with Client(f"http://127.0.0.1:{port}", api_key=server.key) as c:
                    via = await c.get(sb.id)
                    r = await via.run("echo ran >> /tmp/count; wc -l < /tmp/count")
                    assert (r.exit_code, r.stdout.strip()) == (0, "1")
                    info = await via.start("echo started >> /tmp/started")
                    assert (await via.attach(info.exec_id)).exit_code == 0
                assert len(dropped) == 2, dropped          # both answers were lost once
                assert (await sb.run("wc -l < /tmp/count; wc -l < /tmp/started")).stdout.split() == ["1", "1"]
            finally:
                await sb.stop()
    finally:
        proxy.close()
