"""Lifecycle events (docs/events.md) on the real server: one end-reason vocabulary (a stop is
`killed`, an idle TTL `ttl`, an absolute lifetime `lifetime`, the OOM killer `oom_killed`,
infrastructure), the SDK's typed exceptions carrying it, the event stream resumed from an id,
projects seeing only their own events, and webhooks: signed, retried while the receiver is
down, delivered once it is back, with their delivery status."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import sqlite3
from pathlib import Path

import pytest

from dsec.sdk.client import Client
from dsec.testing.receiver import Receiver
from dsec.testing.waiting import wait_until, wait_until_sync
from dsec.types import (Conflict, EndedByUser, EventType, InfrastructureFailure, SandboxEnded, SandboxFailed,
                        is_infrastructure)
from conftest import stranger_key


async def ended_event(client: Client, sandbox_id: str, within_s: float = 30.0):
    """The sandbox's `ended` event once the apiserver has pulled it (polls: the pull is periodic)."""
    async def found():
        evs = (await client.events(sandbox_id=sandbox_id)).events
        return next((e for e in evs if e.type == EventType.ended), None)
    return await wait_until(found, timeout_s=within_s, what=f"the ended event of {sandbox_id}")


def agent_pid(server, sandbox_id: str) -> int:
    return int((server.paths.sandboxes / sandbox_id / "run" / "pid").read_text())


async def test_end_reasons_and_typed_exceptions(client, server):
    """stop -> killed, idle TTL -> ttl, lifetime -> lifetime (the user's own ends); the OOM
    killer -> oom_killed (infrastructure). A run() on the OOM-killed sandbox raises
    InfrastructureFailure (still a SandboxFailed); on the stopped one, EndedByUser."""
    stopped = await client.create_container(image="busybox")
    idle = await client.create_container(image="busybox", ttl_idle_s=1)
    timed = await client.create_container(image="busybox", lifetime_s=1)
    oom = await client.create_container(image="busybox", memory_mb=32)
    try:
        r = await oom.run("(sleep 1; head -c 40000000 /dev/zero > /dev/shm/fill) >/dev/null 2>&1 &")
        assert r.exit_code == 0, r
        Path(f"/proc/{agent_pid(server, oom.id)}/oom_score_adj").write_text("1000")
        await stopped.stop()

        got = {sb.id: await ended_event(client, sb.id) for sb in (stopped, idle, timed, oom)}
        assert got[stopped.id].reason == "killed" and got[stopped.id].infrastructure is False, got[stopped.id]
        assert got[idle.id].reason == "ttl", got[idle.id]
        assert "ttl_idle_s" in (got[idle.id].message or ""), got[idle.id]      # the free text stays beside it
        assert got[timed.id].reason == "lifetime", got[timed.id]
        e = got[oom.id]
        assert e.reason == "oom_killed" and e.infrastructure is True, e
        assert "out of memory (memory_mb=32)" in (e.message or ""), e
        assert (await oom.refresh()).end_reason == "oom_killed"

        with pytest.raises(InfrastructureFailure) as exc:
            await oom.run("true")
        assert exc.value.reason == "oom_killed" and exc.value.infrastructure
        assert isinstance(exc.value, SandboxFailed | Conflict), type(exc.value).__mro__
        with pytest.raises(EndedByUser) as exc2:
            await stopped.run("true")
        assert exc2.value.reason == "killed" and not exc2.value.infrastructure
        assert isinstance(exc2.value, Conflict) and isinstance(exc2.value, SandboxEnded)

        text = (await client._request("GET", "/metrics")).text     # counted by reason, no sandbox label
        assert 'reason="oom_killed"' in text and "dsec_sandbox_ends_total" in text
        created = [e for e in (await client.events(sandbox_id=oom.id)).events if e.type == EventType.created]
        assert created and created[0].details["memory_mb"] == 32 and created[0].project == e.project
    finally:
        for sb in (stopped, idle, timed, oom):
            await sb.stop()


async def test_stream_resumes_from_an_id(client):
    """A follower gets new events as they come; one that reconnects after the last id it saw
    gets the rest, nothing twice, nothing lost."""
    start = (await client.events(after=0, limit=1000))
    after = start.last_id
    while len(start.events) == 1000:
        start = await client.events(after=after, limit=1000)
        after = start.last_id
    sb = await client.create_container(image="busybox")
    seen = []

    async def first_one():
        async for ev in client.follow_events(after=after, sandbox_id=sb.id):
            seen.append(ev)
            return
    await asyncio.wait_for(first_one(), 30)
    assert seen[0].type == EventType.created, seen
    await sb.set_timeout(600)        # updated
    await sb.stop()                  # ended

    async def rest():
        async for ev in client.follow_events(after=seen[-1].id, sandbox_id=sb.id):
            seen.append(ev)
            if ev.type == EventType.ended:
                return
    await asyncio.wait_for(rest(), 30)
    assert [e.type for e in seen] == [EventType.created, EventType.updated, EventType.ended], seen
    ids = [e.id for e in seen]
    assert ids == sorted(set(ids)), ids

    # SSE: a client reconnecting with Last-Event-ID gets what came after it, each with its id
    import httpx
    h = {"Authorization": f"Bearer {client._api_key}", "Accept": "text/event-stream", "Last-Event-ID": str(ids[0])}
    got: list[tuple[str, str]] = []
    async with httpx.AsyncClient(base_url=client.url, headers=h, timeout=30) as c:
        async with c.stream("GET", "/v1/events", params={"follow": "true", "sandbox_id": sb.id}) as r:
            assert r.headers["content-type"].startswith("text/event-stream"), r.headers
            field: dict[str, str] = {}
            async for line in r.aiter_lines():
                if line.startswith(("id: ", "event: ")):
                    k, _, v = line.partition(": ")
                    field[k] = v
                elif not line and field:
                    got.append((field["id"], field["event"]))
                    field = {}
                    if got[-1][1] == "ended":
                        break
    assert got == [(str(ids[1]), "updated"), (str(ids[2]), "ended")], got


async def test_a_project_sees_only_its_own_events(client, server):
    other = Client(server.url, stranger_key(server, "events"), autostart=False)
    async with other:
        theirs = await other.create_container(image="busybox")
        mine = await client.create_container(image="busybox")
        try:
            await theirs.stop()
            await mine.stop()
            await ended_event(client, theirs.id)          # the admin sees every project's
            await ended_event(other, theirs.id)
            assert not (await other.events(sandbox_id=mine.id)).events
            page = await other.events(limit=1000)
            assert page.events and {e.project for e in page.events} == {theirs.info.project}, page
        finally:
            await mine.stop()


# -- webhooks ----------------------------------------------------------------------------------
async def test_webhook_retried_while_the_receiver_is_down(client, server):
    """Events of a sandbox made while the receiver is down are queued durably and retried
    (the delivery status says so); once it is up they arrive, signed (HMAC-SHA256 over
    timestamp.body), each event at least once. The signing secret is stored encrypted (D57's key)."""
    rx = Receiver()
    hook = await client.add_webhook(rx.url, secret="s" * 32,
                                    events=["created", "ended"])
    try:
        assert hook.secret == "s" * 32 and hook.id in {h.id for h in await client.webhooks()}
        with sqlite3.connect(server.paths.iam_db) as db:
            stored = db.execute("SELECT secret FROM webhooks WHERE id=?", (hook.id,)).fetchone()[0]
        assert stored.startswith("fernet:") and "s" * 32 not in stored, stored
        sb = await client.create_container(image="busybox")
        await sb.stop()

        async def retried():
            d = await client.webhook_deliveries(hook.id)
            mine = [x for x in d.deliveries if x.attempts >= 1 and x.status == "pending"]
            return d if len(mine) >= 2 else None
        d = await wait_until(retried, timeout_s=30, what="failed attempts while the receiver is down")
        assert d.delivered == 0 and all(x.last_error for x in d.deliveries if x.attempts), d

        rx.start()

        async def arrived():
            d = await client.webhook_deliveries(hook.id)
            return d if d.pending == 0 and d.delivered >= 2 else None
        d = await wait_until(arrived, timeout_s=60, what="the deliveries after the receiver came back")
        bodies = []
        for headers, body in rx.got:
            want = "v1=" + hmac.new(b"s" * 32, headers["dsec-timestamp"].encode() + b"." + body,
                                    hashlib.sha256).hexdigest()
            assert hmac.compare_digest(headers["dsec-signature"], want), headers
            assert headers["dsec-webhook-id"] == hook.id
            bodies.append(json.loads(body))
        types = {(b["sandbox_id"], b["type"]) for b in bodies}
        assert {(sb.id, "created"), (sb.id, "ended")} <= types, bodies
        ended = next(b for b in bodies if b["type"] == "ended")
        assert ended["reason"] == "killed" and ended["infrastructure"] is False
    finally:
        await client.remove_webhook(hook.id)
        rx.stop()
    assert hook.id not in {h.id for h in await client.webhooks()}


def test_vocabulary_split():
    assert is_infrastructure("oom_killed") and is_infrastructure("node_lost") and is_infrastructure("agent_died")
    assert not is_infrastructure("killed") and not is_infrastructure("ttl") and not is_infrastructure("lifetime")


def test_cli_webhook_and_events(server):
    """`dsec webhook add|ls|deliveries|rm` and `dsec events --sandbox`."""
    import subprocess
    import sys
    env = {**server.env, "DSEC_API_KEY": server.key}

    def dsec(*args: str) -> str:
        p = subprocess.run([sys.executable, "-m", "dsec", *args], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    hook_id, secret = dsec("webhook", "add", "http://127.0.0.1:9/cli", "--events", "ended").split()[:3:2]
    assert hook_id.startswith("wh_") and secret.startswith("whsec_"), (hook_id, secret)
    assert hook_id in dsec("webhook", "ls")
    assert "pending" in dsec("webhook", "deliveries", hook_id)
    dsec("webhook", "rm", hook_id)
    assert hook_id not in dsec("webhook", "ls")
    sid = dsec("sandbox", "create", "busybox").strip()
    dsec("sandbox", "rm", sid)
    lines = wait_until_sync(lambda: [json.loads(x) for x in dsec("events", "--sandbox", sid).splitlines()
                                     if '"ended"' in x], timeout_s=30, what="the CLI's ended event")
    assert lines[0]["reason"] == "killed", lines


async def test_pause_and_resume_are_events(client):
    """Parking a sandbox and its next request's resume are `paused` (saying where its memory
    went) and `resumed`, in that order, after `created`."""
    sb = await client.create_container(image="busybox")
    try:
        await sb.suspend()
        assert (await sb.run("echo back")).stdout == "back\n"       # resumes it

        async def both():
            evs = (await client.events(sandbox_id=sb.id)).events
            return evs if [e.type for e in evs][:3] == [EventType.created, EventType.paused, EventType.resumed] else None
        evs = await wait_until(both, timeout_s=30, what="created, paused, resumed")
        assert evs[1].details.get("where") in ("memory", "disk"), evs[1]
    finally:
        await sb.stop()
