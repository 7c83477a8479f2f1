"""IAM over HTTP and the CLI (apiserver/iam_routes.py): projects nested to any depth, keys per
project, quota delegated down the tree and never beyond what the delegator holds; a key reaches
its own project and those below it, nothing else (others look missing). Real server, real
HTTP, the real CLI."""

from __future__ import annotations

import os

import httpx
import pytest

from dsec.sdk.client import Client
from dsec.types import Conflict, Forbidden, NotFound, Unauthorized


def _name(prefix: str) -> str:
    return f"{prefix}-{os.urandom(3).hex()}"


async def test_nested_projects_keys_and_delegation(server, client):
    root = (await client.projects())[0]
    assert root.parent_id is None
    org = await client.create_project(_name("org"), max_sandboxes=20, max_cpu_cores=16, max_memory_mb=16384)
    assert org.parent_id == root.id                      # default parent: the caller's project
    org_key = await client.create_key(org.id)
    assert org_key.key.startswith("dsk_") and org_key.project_id == org.id
    async with Client(server.url, org_key.key) as o:
        # nested to any depth, each level delegating part of what it holds
        chain = [org]
        for depth in range(5):
            chain.append(await o.create_project(f"level{depth}", chain[-1].id,
                                                max_sandboxes=10 - depth, max_cpu_cores=8 - depth))
        leaf = chain[-1]
        assert (leaf.max_sandboxes, leaf.max_cpu_cores, leaf.max_memory_mb) == (6, 4.0, 16384)
        assert [p.id for p in await o.projects()] == [p.id for p in chain]
        assert (await o.project(leaf.id)).parent_id == chain[-2].id

        with pytest.raises(Forbidden) as ei:              # more than the parent holds
            await o.create_project("greedy", leaf.id, max_cpu_cores=4.5)
        assert ei.value.field == "max_cpu_cores"
        with pytest.raises(Forbidden):                    # nor can it raise its own project's quota
            await o.set_quota(org.id, max_sandboxes=21)
        with pytest.raises(Forbidden):
            await o.set_quota(leaf.id, max_memory_mb=16385)
        q = await o.set_quota(leaf.id, max_memory_mb=2048)
        assert q.max_memory_mb == 2048 and q.used.sandboxes == 0
        with pytest.raises(Conflict) as ei:               # below a sub-project's: take it back from there first
            await o.set_quota(chain[1].id, max_sandboxes=5)
        assert chain[2].id in ei.value.message
        r = httpx.post(f"{server.url}/v1/projects", json={"name": "bad name!", "parent_id": org.id},
                       headers={"Authorization": f"Bearer {org_key.key}"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "name", r.text
        r = httpx.post(f"{server.url}/v1/projects", json={"name": "x", "max_sandboxes": -1},
                       headers={"Authorization": f"Bearer {org_key.key}"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "max_sandboxes", r.text

        # keys per project: create, list, revoke
        leaf_key = await o.create_key(leaf.id)
        extra = await o.create_key(leaf.id)
        assert [k.id for k in await o.keys(leaf.id)] == [leaf_key.id, extra.id]
        async with Client(server.url, leaf_key.key) as lf:
            assert [p.id for p in await lf.projects()] == [leaf.id]
            for call in (lf.project(org.id), lf.keys(org.id), lf.create_key(chain[-2].id), lf.quota(org.id),
                         lf.revoke_key(org_key.id), lf.create_project("x", org.id)):
                with pytest.raises(NotFound):             # above it: looks missing
                    await call
            with pytest.raises(Forbidden):                # its own quota is set from above
                await lf.set_quota(leaf.id, max_sandboxes=1)
            await o.revoke_key(leaf_key.id)
            with pytest.raises(Unauthorized, match="revoked"):
                await lf.projects()
        assert [k.revoked for k in await o.keys(leaf.id)] == [True, False]

        # removal: only empty projects, from above
        with pytest.raises(Conflict) as ei:
            await o.delete_project(chain[-2].id)
        assert leaf.id in ei.value.fix
        await o.delete_project(leaf.id)
        with pytest.raises(NotFound):
            await o.project(leaf.id)
        with pytest.raises(Unauthorized):                 # its keys went with it
            async with Client(server.url, extra.key) as gone:
                await gone.projects()


async def test_other_tenants_projects_and_keys_look_missing(server, client):
    a = await client.create_project(_name("tenant-a"))
    b = await client.create_project(_name("tenant-b"))
    a_key = (await client.create_key(a.id)).key
    b_key = await client.create_key(b.id)
    async with Client(server.url, a_key) as ca:
        for call in (ca.project(b.id), ca.keys(b.id), ca.create_key(b.id), ca.quota(b.id), ca.delete_project(b.id),
                     ca.revoke_key(b_key.id), ca.set_quota(b.id, max_sandboxes=1),
                     ca.create_project("under-b", b.id)):
            with pytest.raises(NotFound) as ei:
                await call
            assert b.name not in ei.value.message
        with pytest.raises(Forbidden):                    # a key cannot remove its own project
            await ca.delete_project(a.id)
    assert not (await client.keys(b.id))[0].revoked
    await client.delete_project(a.id)
    await client.delete_project(b.id)


def test_cli_project_and_key_commands(server):
    """The real CLI (its typer app, in-process: an interpreter start per command costs seconds
    on a loaded box) against the real server."""
    from typer.testing import CliRunner

    from dsec.cli.main import app
    runner = CliRunner()
    env = {"DSEC_URL": server.url, "DSEC_API_KEY": server.key, "DSEC_HOME": str(server.home)}

    def dsec(*args: str, key: str | None = None, ok: bool = True) -> str:
        r = runner.invoke(app, list(args), env={**env, **({"DSEC_API_KEY": key} if key else {})})
        assert (r.exit_code == 0) == ok, (args, r.output, r.exception)
        return r.output

    name = _name("cli")
    pid = dsec("project", "create", name, "--max-sandboxes", "4", "--max-cpu-cores", "2").strip()
    assert pid.startswith("prj-")
    assert name in dsec("project", "ls")
    key = dsec("key", "create", pid).strip()
    assert key.startswith("dsk_")
    sub = dsec("project", "create", "sub", "--max-sandboxes", "2", key=key).strip()
    out = dsec("project", "create", "too-big", "--parent", pid, "--max-cpu-cores", "3", key=key, ok=False)
    assert "max_cpu_cores" in out and "fix:" in out
    out = dsec("project", "quota", sub, "--max-sandboxes", "3", key=key)
    assert "sandboxes" in out and "3" in out
    assert "sandboxes" in dsec("project", "quota", pid)
    key_id = next(w for w in dsec("key", "ls", pid).split() if w.startswith("key-"))
    dsec("project", "rm", sub, key=key)
    dsec("key", "revoke", key_id)
    assert "revoked" in dsec("project", "ls", key=key, ok=False)
    dsec("project", "rm", pid)
    assert pid not in dsec("project", "ls")


async def test_key_rotation_without_downtime(server, client):
    """Issue 22, item 9: a key is replaced by a new one of the same project; the old one keeps
    working for the grace period, then is refused naming the rotation."""
    p = await client.create_project(_name("rot"))
    first = await client.create_key(p.id)
    async with Client(server.url, first.key) as c1:
        second = await c1.rotate_key(grace_s=3600)          # "self": the key c1 uses
        assert second.project_id == p.id and second.key != first.key
        assert await c1.projects()                           # the old key still works (grace)
        async with Client(server.url, second.key) as c2:
            assert (await c2.projects())[0].id == p.id
            listed = {k.id: k for k in await c2.keys(p.id)}
            assert listed[first.id].expires_at is not None and listed[second.id].expires_at is None
            third = await c2.rotate_key(second.id, grace_s=0)   # ends the second key now
        async with Client(server.url, second.key) as c2:
            with pytest.raises(Unauthorized) as e:
                await c2.projects()
            assert "rotated" in e.value.message and e.value.fix
        async with Client(server.url, third.key) as c3:
            assert (await c3.projects())[0].id == p.id
            # a key of another project is not the caller's to rotate
            with pytest.raises(NotFound):
                await c3.rotate_key((await client.keys((await client.projects())[0].id))[0].id)
    with pytest.raises(Exception) as e:
        await client.rotate_key(first.id, grace_s=-1)
    assert getattr(e.value, "field", None) == "grace_s"


def test_admin_key_rotation_rewrites_admin_key_and_keeps_serving(dsec_home, images, tmp_path_factory):
    """`dsec key rotate --admin`: the node's admin key file holds the new key at once, the old key
    works through the grace period, the server never stops."""
    import subprocess
    import sys

    from conftest import side_server
    with side_server(dsec_home, tmp_path_factory, "rotate") as srv:
        old = srv.key
        r = subprocess.run([sys.executable, "-m", "dsec", "key", "rotate", "--admin", "--grace-s", "600"],
                           env={k: v for k, v in srv.env.items() if k != "DSEC_API_KEY"},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        new = srv.key
        assert new != old and (srv.paths.admin_key_file.stat().st_mode & 0o777) == 0o600
        for key in (old, new):
            assert httpx.get(f"{srv.url}/v1/projects", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # a restart adopts the new key from the file
        srv.kill(15)
        srv.start()
        assert httpx.get(f"{srv.url}/v1/projects", headers={"Authorization": f"Bearer {new}"}).status_code == 200
