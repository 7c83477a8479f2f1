"""E2B's lifecycle events API and webhooks on dsec (docs/events.md, docs/e2b.md): a sandbox the
stock SDK creates and kills shows as sandbox.lifecycle.created / .killed in
GET /events/sandboxes/{id}, and a webhook registered at /events/webhooks receives E2B's payload
signed with E2B's scheme (e2b-signature: unpadded base64 SHA-256 of secret + body)."""

from __future__ import annotations

import base64
import hashlib
import json

import httpx
from e2b import Sandbox

from dsec.testing.waiting import wait_until
from dsec.testing.receiver import Receiver


def e2b_signature(secret: str, body: bytes) -> str:
    return base64.b64encode(hashlib.sha256(secret.encode() + body).digest()).decode().rstrip("=")


async def test_events_api_and_webhook_with_e2b_signatures(e2b_env, server):
    rx = Receiver()
    rx.start()
    h = {"X-API-Key": server.key}
    async with httpx.AsyncClient(base_url=e2b_env, headers=h, timeout=30) as c:
        r = await c.post("/events/webhooks", json={
            "name": "test hook", "url": f"http://127.0.0.1:{rx.port}/e2b", "enabled": True,
            "events": ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"], "signatureSecret": "e2b-secret"})
        assert r.status_code == 201, r.text
        hook = r.json()
        try:
            assert hook["events"] == ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"], hook
            assert hook["id"] in {x["id"] for x in (await c.get("/events/webhooks")).json()}
            sbx = Sandbox.create("busybox", timeout=120)
            sbx.kill()

            async def both() -> list[dict] | None:
                got = [json.loads(b) for _, b in rx.got]
                mine = [g for g in got if g["sandboxId"] == sbx.sandbox_id]
                return mine if {g["type"] for g in mine} >= {"sandbox.lifecycle.created",
                                                             "sandbox.lifecycle.killed"} else None
            mine = await wait_until(both, timeout_s=30, what="both webhook deliveries")
            for headers, body in rx.got:
                assert headers["e2b-signature"] == e2b_signature("e2b-secret", body), headers
                assert headers["e2b-signature-version"] == "v1" and headers["e2b-webhook-id"] == hook["id"]
            killed = next(g for g in mine if g["type"] == "sandbox.lifecycle.killed")
            assert killed["version"] == "v2" and killed["eventData"]["reason"] == "killed", killed

            r = await c.get(f"/events/sandboxes/{sbx.sandbox_id}", params={"orderAsc": "true"})
            assert r.status_code == 200, r.text
            labels = [e["eventLabel"] for e in r.json()]
            assert labels[0] == "create" and labels[-1] == "kill", r.json()
            assert (await c.patch(f"/events/webhooks/{hook['id']}", json={"enabled": False})).json()["enabled"] is False
        finally:
            assert (await c.delete(f"/events/webhooks/{hook['id']}")).status_code == 200
            rx.stop()
        assert (await c.get(f"/events/webhooks/{hook['id']}")).status_code == 404
