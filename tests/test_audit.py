"""The audit log (issue 26.4, apiserver/audit.py): who (which key) created, changed, stopped or
read what, per project, readable by the project's admin keys (GET /v1/audit, `dsec audit`),
never with secret values, command text or file contents; member keys are refused naming the
role; entries past DSEC_AUDIT_RETENTION_S are pruned."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dsec.apiserver.audit import AuditLog
from dsec.iam import IAM
from dsec.sdk.client import Client
from dsec.store.audit import AuditStore, Query, Record
from dsec.testing.waiting import wait_until, wait_until_sync
from dsec.types import Forbidden, NotFound

MARK_CMD = "audit-cmd-text-4711"
MARK_DATA = "audit-file-contents-4711"
MARK_SECRET = "audit-secret-value-4711"


async def _project_admin(root: Client, server, name: str) -> tuple[str, Client]:
    p = await root.create_project(f"{name}-{time.monotonic_ns() % 10**8}")
    k = await root.create_key(p.id)
    return p.id, Client(server.url, k.key, autostart=False)


async def _entries(c: Client, **kw) -> list:
    out, before = [], None
    while True:
        page = await c.audit(before=before, limit=kw.pop("limit", 500), **kw)
        out += page.entries
        if page.next_before is None:
            return out
        before = page.next_before


async def test_admin_reads_its_own_project_not_others(client, server):
    a_id, a = await _project_admin(client, server, "audit-a")
    b_id, b = await _project_admin(client, server, "audit-b")
    async with a, b:
        sb = await a.create_container(image="busybox")
        try:
            assert (await sb.run(f"echo {MARK_CMD}")).exit_code == 0
            await sb.files.write("/tmp/audit.txt", MARK_DATA)
            assert MARK_DATA in (await sb.files.read("/tmp/audit.txt")).decode()
            await a.create_secret("audit-s", MARK_SECRET, ["example.com"], header="X-Token")
            await a.delete_secret("audit-s")
        finally:
            await sb.stop()

        async def all_there() -> list | None:
            got = await _entries(a)
            acts = {(e.action, e.target) for e in got}
            want = {("sandbox.create", sb.id), ("exec.start", sb.id), ("file.write", sb.id), ("file.read", sb.id),
                    ("sandbox.stop", sb.id), ("secret.create", "audit-s"), ("secret.delete", "audit-s")}
            return got if want <= acts else None
        got = await wait_until(all_there, timeout_s=30, what="the project's audit entries")
        assert {e.project for e in got} == {a_id}, got
        assert len({e.key_id for e in got}) == 1 and all(e.status < 300 for e in got), got
        write = next(e for e in got if e.action == "file.write")
        assert write.details["path"] == "/tmp/audit.txt", write
        text = "".join(e.model_dump_json() for e in got)
        for mark in (MARK_CMD, MARK_DATA, MARK_SECRET):
            assert mark not in text, mark

        # filters and pages
        only = await a.audit(action="file.", target=sb.id)
        assert {e.action for e in only.entries} == {"file.write", "file.read"}, only
        p1 = await a.audit(limit=2)
        p2 = await a.audit(limit=2, before=p1.next_before)
        assert p1.next_before and len(p1.entries) == 2 and p2.entries, (p1, p2)
        assert p1.entries[-1].id > p2.entries[0].id and p1.entries[0].at >= p2.entries[0].at

        # another project's admin sees none of it, and may not ask for it
        assert not [e for e in await _entries(b) if e.project == a_id or e.target == sb.id]
        with pytest.raises(NotFound) as e:
            await b.audit(project=a_id)
        assert e.value.field == "project"
        # the root project's admin sees every project's, and filters by one
        assert {e.target for e in await _entries(client, project=a_id)} >= {sb.id}


async def test_member_key_is_refused_naming_the_role(client, server):
    p = await client.create_project(f"audit-m-{time.monotonic_ns() % 10**8}")
    member = await client.create_key(p.id, role="member")
    assert member.role == "member"
    async with Client(server.url, member.key, autostart=False) as m:
        with pytest.raises(Forbidden) as e:
            await m.audit()
        assert e.value.field == "role" and "'member'" in e.value.message and "'admin'" in e.value.message, e.value
        # nor may it mint itself an admin key (which could read the log)
        with pytest.raises(Forbidden) as e:
            await m.create_key(p.id, role="admin")
        assert e.value.field == "role"
    # the refusals are recorded too, for the project's admins
    got = await wait_until(lambda: _refused(client, p.id), timeout_s=30, what="the refused key.create entry")
    assert got.key_id == member.id and got.status == 403


async def _refused(c: Client, project: str):
    return next((e for e in (await c.audit(project=project, action="key.create")).entries if e.status == 403), None)


async def test_pruned_after_retention(tmp_path: Path):
    """The writer drops entries older than the retention (a real SQLite control store)."""
    with IAM(tmp_path / "iam.db") as iam:
        log = AuditLog(AuditStore(iam.db), retention_s=2.0)
        now = time.time()
        log.note(Record(at=now - 3600, project_id="p", key_id="k", action="sandbox.create", target="old", status=201))
        log.note(Record(at=now + 3600, project_id="p", key_id="k", action="sandbox.create", target="new", status=201))
        log.start()
        try:
            async def pruned() -> bool:
                left = {e.target for e in log.store.query(Query(projects=["p"])).entries}
                return left == {"new"}
            await wait_until(pruned, timeout_s=30, what="the old entry to be pruned")
        finally:
            await log.stop()


def test_cli_key_roles_and_audit(server):
    """`dsec key create --role member`, `dsec key ls` shows roles, `dsec audit --json --action key.`;
    the member key's `dsec audit` fails naming the role."""
    import json
    import subprocess
    import sys
    env = {**server.env, "DSEC_API_KEY": server.key}

    def dsec(*args: str, ok: bool = True, key: str | None = None) -> str:
        p = subprocess.run([sys.executable, "-m", "dsec", *args], capture_output=True, text=True, timeout=120,
                           env={**env, **({"DSEC_API_KEY": key} if key else {})})
        assert (p.returncode == 0) == ok, p.stdout + p.stderr
        return p.stdout + p.stderr

    project = dsec("project", "create", f"audit-cli-{time.monotonic_ns() % 10**8}").split()[0]
    member = dsec("key", "create", project, "--role", "member").strip().splitlines()[-1]
    assert member.startswith("dsk_") and "member" in dsec("key", "ls", project)
    assert "role" in dsec("audit", ok=False, key=member)

    def logged() -> list:      # under the acting (root) key's project; the key's project in details
        out = dsec("audit", "--json", "--action", "key.", "--limit", "500")
        return [e for e in map(json.loads, filter(lambda line: line.startswith("{"), out.splitlines()))
                if e["details"].get("project") == project]
    got = wait_until_sync(logged, timeout_s=60, every_s=1.0, what="the key.create entry")
    assert {e["action"] for e in got} == {"key.create"} and {e["status"] for e in got} == {201}, got
