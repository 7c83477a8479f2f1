"""A project cannot lift the bound on how fast it creates (apiserver/fair_creates.py): its own
key may not loosen its policy's max_creates_per_s / max_create_burst, nor give a sub-project a
faster rate than its own; its creates beyond the rate are refused (429), others' are not."""

from __future__ import annotations

import os

import pytest

from dsec.sdk.client import Client
from dsec.types import CapacityExceeded, Forbidden


async def test_a_project_cannot_raise_its_own_create_rate(server, cx):
    p = await cx.create_project(f"cx-rate-{os.urandom(3).hex()}")
    await cx.set_policy(p.id, {"max_creates_per_s": 0.1, "max_create_burst": 1})
    key = (await cx.create_key(p.id)).key
    async with Client(server.url, key, busy_retry_s=0) as own:     # the refusal itself, not waited out
        for policy in ({"max_creates_per_s": 1000}, {"max_create_burst": 1000}, {}):
            with pytest.raises(Forbidden):
                await own.set_policy(p.id, policy)          # its own policy is set from above
        child = await own.create_project("faster")
        for field in ("max_creates_per_s", "max_create_burst"):
            with pytest.raises(Forbidden) as e:
                await own.set_policy(child.id, {field: 50})
            assert e.value.field == field
        sb = await own.create_container(image="busybox", memory_mb=32)
        try:
            with pytest.raises(CapacityExceeded) as e:
                await own.create_container(image="busybox", memory_mb=32)
            assert e.value.field == "max_creates_per_s" and e.value.retry_after_s >= 1   # the SDK reads Retry-After
            neighbour = await cx.create_container(image="busybox", memory_mb=32)   # the root project is not held
            await neighbour.stop()
        finally:
            await sb.stop()
