"""The audit log's cost on the request path (issue 26 item 6, apiserver/audit.py): a request
leaves a note (Noted) and the writer builds its entry in its own thread, so what the log keeps
is unchanged (action, target, status, the file's path, E2B ids as dsec's, the access token's
actor) while the event loop does an append. A real AuditRecorder around a small ASGI app, a
real AuditLog on a real SQLite control store."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dsec.apiserver.audit import E2B_TARGET_KEY, E2B_TOKEN_ACTOR, AuditLog, AuditRecorder, Noted, note_target
from dsec.iam import IAM, Principal
from dsec.store.audit import AuditStore, Query, Record


def _app(status: int, target: str | None = None, e2b: Any = None):
    async def app(scope, receive, send) -> None:
        if target:
            note_target(target)
        if e2b is not None:
            scope["state"][E2B_TARGET_KEY] = e2b       # what the E2B dispatcher resolves
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
    return app


async def _request(mw: AuditRecorder, method: str, path: str, query: bytes = b"", who: Any = None) -> None:
    scope = {"type": "http", "method": method, "path": path, "query_string": query,
             "state": {"dsec_principal": who} if who else {}}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(_: dict[str, Any]) -> None:
        pass
    await mw(scope, receive, send)


async def test_requests_leave_notes_and_the_writer_builds_entries(tmp_path: Path):
    with IAM(tmp_path / "iam.db") as iam:
        log = AuditLog(AuditStore(iam.db), retention_s=3600)
        ctx = SimpleNamespace(runtime=SimpleNamespace(audit=log))
        who = Principal(project_id="p1", key_id="k1", project_name="p1")
        built_in: set[str] = set()
        record = Noted.record

        def tracking(self: Noted) -> Record | None:     # the real method, noting where it ran
            built_in.add(threading.current_thread().name)
            return record(self)
        Noted.record = tracking   # type: ignore[method-assign]
        try:
            await _request(AuditRecorder(_app(200), ctx=ctx), "POST", "/v1/sandboxes/sb-n1.abc/exec", who=who)
            await _request(AuditRecorder(_app(200), ctx=ctx), "GET", "/v1/sandboxes/sb-n1.abc/files",
                           b"path=%2Fetc%2Fhosts", who=who)
            await _request(AuditRecorder(_app(201, target="sb-n1.new"), ctx=ctx), "POST", "/v1/sandboxes", who=who)
            await _request(AuditRecorder(_app(200, e2b=SimpleNamespace(info=SimpleNamespace(project="p2"),
                                                                       sandbox_id="n1-0123456789ab")), ctx=ctx),
                           "POST", "/e2b/process.Process/Start")
            await _request(AuditRecorder(_app(401), ctx=ctx), "POST", "/e2b/process.Process/Start")  # nobody to name
            await _request(AuditRecorder(_app(200), ctx=ctx), "GET", "/v1/sandboxes", who=who)        # not audited
            assert len(log.pending) == 5 and all(isinstance(n, Noted) for n in log.pending)
            assert not built_in, "entries were built on the request path"
            assert await log.flush() == 4
        finally:
            Noted.record = record   # type: ignore[method-assign]
        assert built_in and threading.main_thread().name not in built_in
        got = {(e.action, e.target): e for e in log.store.query(Query(projects=None)).entries}
        assert set(got) == {("exec.start", "sb-n1.abc"), ("file.read", "sb-n1.abc"),
                            ("sandbox.create", "sb-n1.new"), ("exec.start", "sb-n1.0123456789ab")}
        assert got["file.read", "sb-n1.abc"].details == {"path": "/etc/hosts"}
        assert got["sandbox.create", "sb-n1.new"].status == 201 and got["sandbox.create", "sb-n1.new"].key_id == "k1"
        e2b = got["exec.start", "sb-n1.0123456789ab"]
        assert (e2b.project, e2b.key_id, e2b.details) == ("p2", E2B_TOKEN_ACTOR, {"via": "e2b"})
        ids = [e.id for e in log.store.query(Query(projects=None)).entries]
        assert len(set(ids)) == 4 and all(len(i) == 24 for i in ids)
