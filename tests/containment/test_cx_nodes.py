"""Operator verbs on nodes (`dsec nodes`, issue 28): another project's key is refused (403)
for cordon, drain, uncordon and forget, and the node keeps taking sandboxes."""

from __future__ import annotations

import httpx
from conftest import stranger_key


async def test_another_project_cannot_cordon_drain_or_forget(server, client):
    node = (await client.nodes())[0].node_id
    key = stranger_key(server, "cx-nodes")
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        for verb in ("cordon", "drain", "uncordon", "forget"):
            r = await c.post(f"/v1/nodes/{node}/{verb}")
            assert r.status_code == 403, (verb, r.text)
            assert "admin" in r.json()["error"]["message"], r.text
    assert [n.state for n in await client.nodes()] == ["active"]
    sb = await client.create_container(image="busybox", memory_mb=64, cpu_cores=0.1)
    await sb.stop()
