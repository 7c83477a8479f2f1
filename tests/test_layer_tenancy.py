"""Images and layers belong to projects (issue: containment round two, item 7).

Before: any key listed every image, built sandboxes on another tenant's workspace layer and
overwrote it with pack_diff(name, replace=True), so the next sandbox read the attacker's files.
Now a packed layer is owned by its sandbox's project: visible to that project and its relatives,
replaced only by it; the operator's images, and what an admin publishes, are visible to all.
"""

from __future__ import annotations

import os

import pytest

from dsec import Client
from dsec.iam import IAM
from dsec.types import Conflict, Forbidden, NotFound


@pytest.fixture
def tenants(server):
    """Two unrelated projects and a sub-project of the first, a key each."""
    sfx = os.urandom(3).hex()
    with IAM(server.paths.iam_db) as iam:
        a = iam.create_project(f"ten-a-{sfx}", iam.root().id)
        a_child = iam.create_project(f"ten-a-child-{sfx}", a.id)
        b = iam.create_project(f"ten-b-{sfx}", iam.root().id)
        return {name: (p.id, iam.create_key(p.id)) for name, p in (("a", a), ("a_child", a_child), ("b", b))}


async def test_a_projects_layer_is_invisible_to_others_and_only_it_replaces_it(server, client, tenants):
    (a_id, a_key), (_, child_key), (_, b_key) = tenants["a"], tenants["a_child"], tenants["b"]
    name = f"ten-ws-{os.urandom(3).hex()}@1"
    async with Client(server.url, a_key) as a, Client(server.url, b_key) as b, \
            Client(server.url, child_key) as child:
        sa = await a.create_container(image="busybox")
        await sa.files.write("/work/owner.txt", b"project a")
        layer = await sa.pack_diff(name)
        assert layer.owner == a_id
        await sa.stop()

        # another project: not listed, unusable (looks missing, naming the field), not replaceable
        assert name not in {i.name for i in await b.images()}
        with pytest.raises(NotFound) as e:
            await b.create_container(image="busybox", workspace=name)
        assert e.value.field == "workspace"
        # ... exactly as a name nobody has (issue 22, item 8: the answers differed)
        missing = f"ten-none-{os.urandom(3).hex()}@1"
        with pytest.raises(NotFound) as e2:
            await b.create_container(image="busybox", workspace=missing)
        assert (e2.value.message.replace(missing, "N"), e2.value.fix) == (e.value.message.replace(name, "N"), e.value.fix)
        sb = await b.create_container(image="busybox")
        try:
            await sb.files.write("/work/owner.txt", b"attacker")
            with pytest.raises(Forbidden) as e:
                await sb.pack_diff(name, replace=True)
            assert e.value.field == "name"
            with pytest.raises(Conflict) as e3:           # the clash tells nothing of the owner's layer
                await sb.pack_diff(name)
            assert e3.value.field == "name" and layer.digest not in e3.value.message
        finally:
            await sb.stop()

        # the owner's sub-project uses it and reads the owner's file, unchanged
        assert name in {i.name for i in await child.images()}
        sc = await child.create_container(image="busybox", workspace=name)
        try:
            assert await sc.files.read("/work/owner.txt") == b"project a"
        finally:
            await sc.stop()
        assert (await client.images()) and layer.digest in {i.digest for i in await a.images() if i.name == name}


async def test_an_admin_publishes_a_layer_to_all_and_only_admins_may(server, client, tenants):
    (_, a_key), (_, b_key) = tenants["a"], tenants["b"]
    name = f"ten-pub-{os.urandom(3).hex()}@1"
    async with Client(server.url, a_key) as a, Client(server.url, b_key) as b:
        sa = await a.create_container(image="busybox")
        await sa.files.write("/work/shared.txt", b"for everyone")
        await sa.pack_diff(name)
        await sa.stop()
        with pytest.raises(Forbidden):
            await a.publish_image(name)           # a project cannot publish, even its own
        published = await client.publish_image(name)   # the admin (root project) key
        assert published.owner is None
        sb = await b.create_container(image="busybox", workspace=name)
        try:
            assert await sb.files.read("/work/shared.txt") == b"for everyone"
            with pytest.raises(Forbidden):        # published: no project takes the name over
                await sb.pack_diff(name, replace=True)
        finally:
            await sb.stop()
