"""Fair creates between projects (issue 28, item 8; apiserver/fair_creates.py): one project's
flood does not starve another's few creates (a round-robin queue in front of placement), and a
project's policy bounds its create rate (429 with Retry-After beyond it). A real server with one
create slot (DSEC_CREATE_CONCURRENCY=1), so that the queue decides the order."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
from conftest import side_server

FLOOD = 16


@pytest.fixture(scope="module")
def fair_server(images, dsec_home, tmp_path_factory):
    with side_server(dsec_home, tmp_path_factory, "fair", {"DSEC_CREATE_CONCURRENCY": "1"}) as srv:
        yield srv


async def _project_key(admin, prefix: str, policy: dict | None = None) -> str:
    p = await admin.create_project(f"{prefix}-{os.urandom(3).hex()}")
    if policy:
        await admin.set_policy(p.id, policy)
    return (await admin.create_key(p.id)).key


async def _stop_all(admin) -> None:
    for sb in await admin.list():
        await (await admin.get(sb.id)).stop()


async def test_a_flood_does_not_starve_another_projects_few_creates(fair_server):
    async with fair_server.client() as admin:
        key_a, key_b = await _project_key(admin, "flood"), await _project_key(admin, "few")
        done: list[tuple[str, float]] = []          # (project, when) of every create that returned
        limits = httpx.Limits(max_connections=FLOOD + 8, max_keepalive_connections=FLOOD + 8)
        async with httpx.AsyncClient(base_url=fair_server.url, timeout=600, limits=limits) as http:
            async def create(who: str, key: str) -> None:
                r = await http.post("/v1/sandboxes", json={"image": "busybox", "memory_mb": 32},
                                    headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 201, r.text
                done.append((who, time.monotonic()))
            try:
                flood = [asyncio.create_task(create("a", key_a)) for _ in range(FLOOD)]
                while len(done) < 2:                # A's creates hold the slot and fill the queue
                    await asyncio.sleep(0.05)
                a_before = len(done)
                await asyncio.gather(*(create("b", key_b) for _ in range(3)))
                a_during = sum(1 for who, _ in done if who == "a") - a_before
                await asyncio.gather(*flood)
            finally:
                await _stop_all(admin)
        # round-robin: one of A's per turn of B's (+1 in the slot when B came); FIFO: all of A's left
        print(f"A's creates that finished while B made 3: {a_during} of {FLOOD - a_before}")
        assert a_during <= 6, f"{a_during} of A's creates went before B's 3"


async def test_a_project_policy_bounds_its_create_rate(fair_server):
    async with fair_server.client() as admin:
        key = await _project_key(admin, "slow", {"max_creates_per_s": 0.2, "max_create_burst": 2})
        other = await _project_key(admin, "other")
        async with httpx.AsyncClient(base_url=fair_server.url, timeout=120) as http:
            async def create(k: str) -> httpx.Response:
                return await http.post("/v1/sandboxes", json={"image": "busybox", "memory_mb": 32},
                                       headers={"Authorization": f"Bearer {k}"})
            try:
                got = [await create(key) for _ in range(3)]
                assert [r.status_code for r in got] == [201, 201, 429], [r.text for r in got]
                err = got[2].json()["error"]
                assert err["field"] == "max_creates_per_s" and "0.2" in err["message"] and err["fix"]
                assert 1 <= int(got[2].headers["retry-after"]) <= 5
                assert (await create(other)).status_code == 201     # another project is not held back
                # a child project cannot be given a faster rate than its parent's policy allows
                r = await http.put(f"/v1/projects/{(await admin.projects())[0].id}/policy",
                                   json={"max_creates_per_s": 0}, headers={"Authorization": f"Bearer {fair_server.key}"})
                assert r.status_code == 422 and r.json()["error"]["field"] == "max_creates_per_s", r.text
            finally:
                await _stop_all(admin)
