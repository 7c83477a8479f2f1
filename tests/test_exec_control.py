"""Exec control through the SDK against a real server: detached execs, followers, stdin,
signals, the running list, idempotency keys (exec and create), the absolute lifetime."""

from __future__ import annotations

import asyncio
import secrets
import time

import httpx
import pytest
from conftest import stranger_key

from dsec import Client, ContainerArgs
from dsec.types import Conflict, NotFound


@pytest.fixture
async def sb(client):
    sandbox = await client.create_container(ContainerArgs(image="busybox", ttl_idle_s=300))
    yield sandbox
    await sandbox.stop()


async def test_detached_exec_returns_at_once_and_result_comes_later(sb):
    t0 = time.monotonic()
    info = await sb.start("sleep 2; echo done", tag="job-1")
    assert time.monotonic() - t0 < 1.5, "start must not wait for the command"
    assert info.running and info.detached and info.tag == "job-1" and info.exec_id
    result = await sb.attach(info.exec_id)
    assert (result.stdout, result.exit_code) == ("done\n", 0)


async def test_followers_get_output_from_the_beginning(sb):
    info = await sb.start("echo one; sleep 1; echo two")
    await asyncio.sleep(0.5)                       # "one" was written before anyone followed

    async def follow() -> str:
        out = ""
        async for ev in sb.follow(info.exec_id):
            if ev.type == "stdout":
                out += ev.data
            elif ev.type == "exit":
                assert ev.result is not None and ev.result.exit_code == 0
        return out

    a, b = await asyncio.gather(follow(), follow())
    assert a == b == "one\ntwo\n"
    assert await follow() == "one\ntwo\n"          # after the end too


async def test_stdin_stays_open_until_closed(sb):
    info = await sb.start("cat; echo end", keep_stdin=True)
    await sb.send_stdin(info.exec_id, "hello\n")
    await sb.send_stdin(info.exec_id, b"world\n", close=True)
    result = await sb.attach(info.exec_id)
    assert result.stdout == "hello\nworld\nend\n"


async def test_stdin_refused_without_keep_stdin(sb):
    info = await sb.start("sleep 30")
    with pytest.raises(Conflict) as e:
        await sb.send_stdin(info.exec_id, "x")
    assert e.value.field == "exec_id" and "keep_stdin" in (e.value.fix or "")
    await sb.signal(info.exec_id, 9)


async def test_signal_ends_only_that_command(sb):
    victim = await sb.start("sleep 100")
    bystander = await sb.start("sleep 3; echo alive")
    await sb.signal(victim.exec_id, 15)
    r = await sb.attach(victim.exec_id)
    assert r.exit_code is None and r.signal == 15
    assert (await sb.attach(bystander.exec_id)).stdout == "alive\n"
    with pytest.raises(Conflict):                 # it has ended
        await sb.signal(victim.exec_id, 15)
    with pytest.raises(NotFound):
        await sb.signal("4242", 15)


async def test_list_shows_running_commands_with_what_started_them(sb):
    detached = await sb.start("sleep 30", tag="bg", cwd="/tmp")
    streamed = asyncio.create_task(sb.run("sleep 2; echo fg"))
    await asyncio.sleep(1.0)
    listed = {e.exec_id: e for e in await sb.execs()}
    assert listed[detached.exec_id].cmd == "sleep 30" and listed[detached.exec_id].tag == "bg"
    assert listed[detached.exec_id].cwd == "/tmp"
    assert any(e.cmd == "sleep 2; echo fg" and not e.detached for e in listed.values())
    assert (await streamed).stdout == "fg\n"
    await sb.signal(detached.exec_id, 9)
    await sb.attach(detached.exec_id)
    assert detached.exec_id not in {e.exec_id for e in await sb.execs()}


async def test_idempotent_exec_runs_once(sb):
    cmd = "echo x >> /tmp/count; wc -l < /tmp/count"
    key = f"k-{secrets.token_hex(4)}"
    first, second = await asyncio.gather(sb.run(cmd, idempotency_key=key), sb.run(cmd, idempotency_key=key))
    third = await sb.run(cmd, idempotency_key=key)          # a retry after it finished
    assert first.exec_id == second.exec_id == third.exec_id
    assert first.stdout.strip() == third.stdout.strip() == "1"
    assert (await sb.run("wc -l < /tmp/count")).stdout.strip() == "1"
    other = await sb.run(cmd, idempotency_key=key + "-2")    # another key runs again
    assert other.stdout.strip() == "2"


async def test_idempotent_exec_survives_a_dropped_client(sb, server):
    """The retry after a client-side timeout gets the first run's result, not a second run."""
    key = f"k-{secrets.token_hex(4)}"
    cmd = "sleep 2; echo y >> /tmp/once; wc -l < /tmp/once"
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}) as h:
        with pytest.raises(httpx.ReadTimeout):
            await h.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": cmd, "idempotency_key": key}, timeout=0.5)
    r = await sb.run(cmd, idempotency_key=key)
    assert r.stdout.strip() == "1"
    await asyncio.sleep(0.5)
    assert (await sb.run("wc -l < /tmp/once")).stdout.strip() == "1"


async def test_idempotent_create_returns_the_same_sandbox(client):
    key = f"c-{secrets.token_hex(4)}"
    args = ContainerArgs(image="busybox", idempotency_key=key)
    root = (await client.projects())[0].id
    before = (await client.quota(root)).used.sandboxes
    a, b = await asyncio.gather(client.create(args), client.create(args))
    try:
        assert a.id == b.id
        held = before + 1
        assert (await client.create(args)).id == a.id
        mine = [s for s in await client.list() if s.id == a.id]
        assert len(mine) == 1
        # the retries' quota reservations were given back: one sandbox, counted once
        assert (await client.quota(root)).used.sandboxes == held
    finally:
        await a.stop()


async def test_idempotency_keys_are_per_project(client, server):
    other = stranger_key(server, "idem")
    key = f"c-{secrets.token_hex(4)}"
    mine = await client.create(ContainerArgs(image="busybox", idempotency_key=key))
    try:
        async with Client(server.url, other) as c2:
            theirs = await c2.create(ContainerArgs(image="busybox", idempotency_key=key))
            try:
                assert theirs.id != mine.id, "another project's key must never hand out this sandbox"
                with pytest.raises(NotFound):
                    await (await c2.get(mine.id)).start("true")
            finally:
                await theirs.stop()
    finally:
        await mine.stop()


async def test_lifetime_ends_a_busy_sandbox(client):
    sb = await client.create_container(ContainerArgs(image="busybox", lifetime_s=4, ttl_idle_s=600))
    assert sb.info.expires_at is not None
    await sb.start("sleep 100")                      # busy: the idle TTL would never end it
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = await sb.refresh()
        if info.state.value not in ("running", "stopping"):   # stopping is a passing state
            break
        await asyncio.sleep(0.5)
    assert info.state.value == "stopped" and "lifetime" in (info.error or "")


async def test_set_timeout_moves_the_end(client):
    sb = await client.create_container(ContainerArgs(image="busybox", lifetime_s=600))
    first_end = sb.info.expires_at
    info = await sb.set_timeout(2)
    assert info.expires_at is not None and first_end is not None and info.expires_at < first_end
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (await sb.refresh()).state.value in ("running", "stopping"):
        await asyncio.sleep(0.5)
    assert sb.info.state.value == "stopped"
    with pytest.raises(Conflict):
        await sb.set_timeout(60)


async def test_bad_exec_control_input_names_the_field(sb, server):
    """The server's own answers (the SDK would refuse these before sending)."""
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}) as h:
        info = await sb.start("sleep 30")
        for path, body, field in [
            (f"/v1/sandboxes/{sb.id}/execs/{info.exec_id}/signal", {"signal": 99}, "signal"),
            (f"/v1/sandboxes/{sb.id}/execs", {"cmd": "true", "tag": "no spaces"}, "tag"),
            (f"/v1/sandboxes/{sb.id}/timeout", {"timeout_s": -1}, "timeout_s"),
            (f"/v1/sandboxes/{sb.id}/exec", {"cmd": "true", "idempotency_key": "a/b"}, "idempotency_key"),
        ]:
            r = await h.post(path, json=body)
            assert r.status_code == 422, (path, r.text)
            assert field in r.json()["error"]["field"], r.text
        await sb.signal(info.exec_id, 9)


async def test_exec_control_cannot_reach_the_agents_own_channels(sb):
    """Channel 0 is the agent's control channel and the top range its internal requests': no
    exec id names them, so stdin, signals and followers cannot be aimed at them."""
    from dsec.agent.client import INTERNAL_CHAN_BASE
    for exec_id in ("0", str(INTERNAL_CHAN_BASE), str(INTERNAL_CHAN_BASE + 5)):
        with pytest.raises(NotFound):
            await sb.signal(exec_id, 9)
        with pytest.raises(NotFound):
            await sb.send_stdin(exec_id, "x")
        with pytest.raises(NotFound):
            await sb.attach(exec_id)
    assert (await sb.run("echo still fine")).stdout == "still fine\n"
