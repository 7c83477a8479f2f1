"""GET /v1/nodes and image locality (D34): a node's status lists the images it holds, which
placement uses; over the API only an admin sees them (they hint at other projects' work)."""

from __future__ import annotations

import asyncio

import httpx

from dsec.placement.locality import image_key

from conftest import stranger_key


async def _cached(server, key: str) -> list[frozenset[str]]:   # type: ignore[no-untyped-def]
    async with httpx.AsyncClient() as h:
        r = await h.get(f"{server.url}/v1/nodes", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return [frozenset(n["cached_images"]) for n in r.json()]


async def test_nodes_list_cached_images_to_admins_only(server, client):   # type: ignore[no-untyped-def]
    async with await client.create_container(image="busybox"):
        want = image_key(_busybox_digest(server))
        for _ in range(50):          # the watcher polls every second
            if any(want in c for c in await _cached(server, server.key)):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"no node lists {want} for the admin")
        assert all(c == frozenset() for c in await _cached(server, stranger_key(server, "loc")))


def _busybox_digest(server) -> str:   # type: ignore[no-untyped-def]
    from dsec.images.service import ImageService
    return ImageService(server.paths).get("busybox").digest
