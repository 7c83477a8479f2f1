"""The audit log and key roles (issue 26.4): untrusted code in a sandbox cannot reach the control
store that holds the log, and what it runs (command text, file contents) never lands in it; a
project's admin key cannot read another project's entries by any filter; a member key cannot
read its own project's, nor mint or rotate its way to an admin key."""

from __future__ import annotations

import httpx
from conftest import stranger_key

from containment._util import py
from dsec.testing.waiting import wait_until

MARK = "cx-audit-mark-5150"


async def test_sandbox_cannot_reach_the_log_and_leaves_no_text_in_it(server, attacker):
    out = await py(attacker, f"""
OUT["db"] = attempt(open, {str(server.paths.iam_db)!r}, "r+b")
OUT["home"] = attempt(os.listdir, {str(server.home)!r})
""")
    assert out["db"] != "ok" and out["home"] != "ok", out
    await attacker.run(f"echo {MARK} > /tmp/{MARK}")
    await attacker.files.write(f"/tmp/{MARK}.2", MARK)
    admin = {"Authorization": f"Bearer {server.key}"}
    async with httpx.AsyncClient(base_url=server.url, headers=admin, timeout=30) as a:
        async def written() -> str | None:     # the path is recorded ...
            r = await a.get("/v1/audit", params={"target": attacker.id, "action": "file.write", "limit": 1000})
            return r.text if r.status_code == 200 and f"/tmp/{MARK}.2" in r.text else None
        await wait_until(written, timeout_s=30, what="the attacker's file.write entry")
        all_of_it = (await a.get("/v1/audit", params={"target": attacker.id, "limit": 1000})).text
    assert f"echo {MARK}" not in all_of_it and f'"{MARK}"' not in all_of_it   # ... not the command or contents


async def test_projects_and_roles_are_kept_apart(server, attacker):
    key = stranger_key(server, "cx-audit")
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        me = (await c.get("/v1/projects")).json()["projects"][0]["id"]
        root = (await c.get("/v1/projects", headers={"Authorization": f"Bearer {server.key}"})).json()["projects"][0]["id"]
        # another project's entries: refused as missing by project, empty by target, key or action
        assert (await c.get("/v1/audit", params={"project": root})).status_code == 404
        for params in ({"target": attacker.id}, {"action": "exec.start"}, {"action": "sandbox."}):
            r = await c.get("/v1/audit", params=params)
            assert r.status_code == 200 and attacker.id not in r.text, (params, r.text)
            assert all(e["project"] == me for e in r.json()["entries"]), r.text
        for bad in ({"action": "x' OR 1=1 --"}, {"before": "zz"}, {"limit": 100000}):
            assert (await c.get("/v1/audit", params=bad)).status_code == 422, bad
        # a member key of the project: no log, no key minting, no rotating an admin key into its own
        member = (await c.post(f"/v1/projects/{me}/keys", params={"role": "member"})).json()
        admin_key_id = (await c.get(f"/v1/projects/{me}/keys")).json()["keys"][0]["id"]
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {member['key']}"},
                                 timeout=30) as m:
        for method, path, params in (("GET", "/v1/audit", {}), ("POST", f"/v1/projects/{me}/keys", {"role": "admin"}),
                                     ("POST", f"/v1/keys/{admin_key_id}/rotate", {"grace_s": 0}),
                                     ("DELETE", f"/v1/keys/{admin_key_id}", {})):
            r = await m.request(method, path, params=params)
            assert r.status_code == 403 and r.json()["error"]["field"] == "role", (path, r.text)
        r = await m.post("/v1/keys/self/rotate", params={"grace_s": 0})      # its own: allowed, stays a member
        assert r.status_code == 201 and r.json()["role"] == "member", r.text
