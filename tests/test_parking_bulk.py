"""Parking by the trainer's handle (bulk by label), idle containers parked by themselves, and
what a parked container costs, as GET reports it. Real containers, real freezer and swap."""

from __future__ import annotations

import asyncio
import secrets
import time

import httpx
import pytest
from conftest import stranger_key

from dsec import Client, ContainerArgs


def _swap_on() -> bool:
    with open("/proc/swaps") as f:
        return len(f.read().splitlines()) > 1


async def test_bulk_suspend_and_resume_by_label(client):
    job = f"job-{secrets.token_hex(3)}"
    mine = await asyncio.gather(*(client.create_container(ContainerArgs(image="busybox", labels={"job": job}))
                                  for _ in range(4)))
    other = await client.create_container(ContainerArgs(image="busybox", labels={"job": job + "-x"}))
    try:
        await mine[0].run("echo kept > /work/f")
        out = await client.suspend_all({"job": job})
        assert sorted(i.id for i in out) == sorted(s.id for s in mine)
        assert all(i.state is not None and i.state.value == "suspended" and i.error is None for i in out)
        assert (await other.refresh()).state.value == "running"          # another label: untouched
        again = await client.suspend_all({"job": job})                  # already parked: no error, no change
        assert all(i.state is not None and i.state.value == "suspended" for i in again)
        back = await client.resume_all({"job": job})
        assert all(i.state is not None and i.state.value == "running" for i in back)
        assert (await mine[0].run("cat /work/f")).stdout == "kept\n"
    finally:
        for s in [*mine, other]:
            await s.stop()


async def test_bulk_calls_never_reach_other_projects(client, server):
    key = stranger_key(server, "bulk")
    label = {"job": f"shared-{secrets.token_hex(3)}"}
    root_sb = await client.create_container(ContainerArgs(image="busybox", labels=label))
    try:
        async with Client(server.url, key) as theirs:
            assert await theirs.suspend_all(label) == []                  # the root project's one is not theirs
        assert (await root_sb.refresh()).state.value == "running"
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}) as h:
            r = await h.post("/v1/sandboxes/bulk/suspend", json={"labels": {}})   # never "everything"
            assert r.status_code == 422 and "labels" in r.json()["error"]["field"]
    finally:
        await root_sb.stop()


async def test_idle_container_parks_itself_and_resumes_on_use(client):
    sb = await client.create_container(ContainerArgs(image="busybox", suspend_idle_s=2, ttl_idle_s=600))
    try:
        await sb.run("echo x > /work/y")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (await sb.refresh()).state.value != "suspended":
            await asyncio.sleep(0.5)
        assert sb.info.state.value == "suspended"
        assert (await sb.run("cat /work/y")).stdout == "x\n"              # the request resumed it
        assert (await sb.refresh()).state.value == "running"
    finally:
        await sb.stop()


async def test_get_reports_resident_and_swapped_memory(client):
    sb = await client.create_container(ContainerArgs(image="debian-python", memory_mb=256))
    try:
        await sb.start("python3 -c \"import os,time; b=os.urandom(64<<20); time.sleep(3600)\"")
        await asyncio.sleep(2)
        running = await sb.refresh()
        assert running.host_pss_mb is not None and running.host_pss_mb >= 60
        await sb.suspend()
        parked = await sb.refresh()
        assert parked.state.value == "suspended" and parked.host_pss_mb is not None
        if not _swap_on():
            pytest.skip("no swap on this host (scripts/host-setup.sh sets up zram): parked memory cannot leave RAM")
        assert parked.host_swap_mb is not None and parked.host_swap_mb >= 50
        assert parked.host_pss_mb < running.host_pss_mb / 2
    finally:
        await sb.stop()
