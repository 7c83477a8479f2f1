"""Usage and metrics (issue 26): a sandbox cannot read another sandbox's usage figures from
inside (cgroup files, the host's /proc), and another project's key gets 404 for a sandbox's
usage routes, 403 for the node-wide metrics and none of the others' series."""

from __future__ import annotations

import httpx
from conftest import stranger_key

from dsec.sdk.client import Client
from dsec.types import NotFound

from containment._util import py


async def test_sandbox_cannot_read_a_neighbours_usage(client):
    victim = await client.create_container(image="busybox")
    attacker = await client.create_container(image="debian-python")
    try:
        await victim.metrics()                  # sampled every 5 s from now: figures exist on the host
        out = await py(attacker, f"""
paths = []
for c in ("memory", "cpuacct", "cpu,cpuacct", "unified", ""):
    for rel in ("dsec/{victim.id}", "../dsec/{victim.id}", "../../dsec/{victim.id}"):
        for f in ("memory.usage_in_bytes", "cpuacct.usage", "memory.current", "cpu.stat", "memory.stat"):
            paths.append(os.path.join("/sys/fs/cgroup", c, rel, f))
OUT["read"] = [p for p in paths if read(p).startswith("ok:")]
OUT["listed"] = attempt(os.listdir, "/sys/fs/cgroup/memory/dsec")
""")
        assert out["read"] == [], out
        assert victim.id not in str(out["listed"]), out
    finally:
        await attacker.stop()
        await victim.stop()


async def test_another_projects_usage_routes(server, client):
    sb = await client.create_container(image="busybox")
    try:
        await sb.run("true")
        key = stranger_key(server, "cx-usage")
        async with Client(server.url, key) as other:
            try:
                await (await other.get(sb.id)).metrics()
                raise AssertionError("another project read the sandbox's usage")
            except NotFound:
                pass
        h = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=server.url, headers=h, timeout=30) as c:
            r = await c.get(f"/v1/sandboxes/{sb.id}/metrics")
            assert r.status_code == 404, r.text
            assert (await c.get("/metrics")).status_code == 403
            for path in ("/v1/metrics", "/v1/nodes/local/metrics"):
                text = (await c.get(path)).text
                assert sb.info.project not in text and sb.id not in text, path
    finally:
        await sb.stop()
