"""The audit log (docs/audit.md) for the stock e2b SDK: its REST calls are logged under its API
key, and its envd traffic (commands, files) under the sandbox's access token in the sandbox's
project: who created the sandbox, what ran (never the command text), which files were written and
read (their paths, never their contents), and the kill."""

from __future__ import annotations

import httpx
import pytest

from dsec.apiserver.e2b.ids import to_dsec
from dsec.testing.waiting import wait_until_sync

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")
from e2b import Sandbox  # noqa: E402

MARK = "e2b-audit-mark-8086"


def test_e2b_sdk_calls_are_in_the_audit_log(e2b_env, server):
    sbx = Sandbox.create("busybox")
    try:
        assert sbx.commands.run(f"echo {MARK}").exit_code == 0
        sbx.files.write("/tmp/e2b-audit.txt", MARK)
        assert sbx.files.read("/tmp/e2b-audit.txt") == MARK
    finally:
        sbx.kill()
    dsec_id = to_dsec(sbx.sandbox_id)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}, timeout=30) as c:
        def logged() -> list | None:
            got = [e for e in c.get("/v1/audit", params={"limit": 1000}).json()["entries"]
                   if e["details"].get("via") == "e2b" and e["target"] == dsec_id]
            acts = {e["action"] for e in got}
            return got if {"sandbox.create", "exec.start", "file.write", "file.read", "sandbox.stop"} <= acts else None
        got = wait_until_sync(logged, timeout_s=60, every_s=0.5, what="the e2b SDK's audit entries")
    by = {e["action"]: e for e in got}
    assert by["sandbox.create"]["key_id"].startswith("key-") and by["exec.start"]["key_id"] == "e2b-access-token"
    assert by["file.write"]["details"]["path"] == "/tmp/e2b-audit.txt" and by["file.write"]["status"] == 200
    assert len({e["project"] for e in got}) == 1, got
    assert MARK not in str(got)
