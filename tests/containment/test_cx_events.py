"""Lifecycle events and webhooks (issue 26.3): untrusted code in a sandbox cannot reach the
edge's event log; a project's key cannot point a webhook at the node's loopback, private or
link-local addresses (the apiserver would POST there for it: the edge service, a cloud's
metadata address), cannot read, change or delete another project's webhooks or deliveries, and
sees none of another project's events."""

from __future__ import annotations

import httpx
from conftest import stranger_key

from containment._util import py

PRIVATE_URLS = ("http://127.0.0.1:7620/v1/sandboxes", "http://localhost:7620/", "http://169.254.169.254/latest/",
                "http://10.0.0.1/", "http://[::1]:7620/", "http://[::ffff:127.0.0.1]/", "http://0.0.0.0:7620/",
                "file:///etc/passwd", "gopher://127.0.0.1/")


async def test_sandbox_cannot_reach_the_event_log(server, attacker):
    out = await py(attacker, f"""
OUT["db"] = attempt(open, {str(server.paths.edge_db)!r}, "r+b")
OUT["home"] = attempt(os.listdir, {str(server.home)!r})
""")
    assert out["db"] != "ok" and out["home"] != "ok", out


async def test_webhooks_are_per_project_and_never_private(server, cx):
    key = stranger_key(server, "cx-events")
    admin = {"Authorization": f"Bearer {server.key}"}
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c, \
            httpx.AsyncClient(base_url=server.url, headers=admin, timeout=30) as a:
        for url in PRIVATE_URLS:
            r = await c.post("/v1/webhooks", json={"url": url})
            assert r.status_code == 422 and r.json()["error"]["field"] == "url", (url, r.text)
            r = await c.post("/e2b/events/webhooks", headers={"X-API-Key": key},
                             json={"url": url, "signatureSecret": "x" * 20})
            assert r.status_code in (400, 422) and "url" in r.text, (url, r.text)
        # the admin's webhook (a private receiver is the admin's choice) is invisible to the project
        hook = (await a.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/none"})).json()
        try:
            assert (await c.get(f"/v1/webhooks/{hook['id']}")).status_code == 404
            assert (await c.get(f"/v1/webhooks/{hook['id']}/deliveries")).status_code == 404
            assert (await c.delete(f"/v1/webhooks/{hook['id']}")).status_code == 404
            assert hook["id"] not in (await c.get("/v1/webhooks")).text
            r = await c.patch(f"/e2b/events/webhooks/{hook['id']}", headers={"X-API-Key": key},
                              json={"url": "https://example.com/"})
            assert r.status_code == 404, r.text
            r = await c.post("/v1/webhooks", json={"url": "https://example.com/h", "project": hook["project"]})
            assert r.status_code == 403 and r.json()["error"]["field"] == "project", r.text
            # the admin's sandboxes' events stay out of the project's stream and E2B's events API
            sb = await cx.create_container(image="busybox")
            await sb.stop()
            assert sb.id not in (await c.get("/v1/events", params={"limit": 1000})).text
            assert sb.id not in (await c.get("/v1/events", params={"sandbox_id": sb.id})).text
            r = await c.get("/e2b/events/sandboxes", headers={"X-API-Key": key}, params={"limit": 100})
            assert r.status_code == 200 and sb.id.split(".")[-1] not in r.text, r.text
        finally:
            await a.delete(f"/v1/webhooks/{hook['id']}")
