"""DSEC_OBSERVABILITY=0 is a real off (issue 26 item 6 measures the cost against it): no metric
updates, no background usage sampling, no lifecycle event rows, no audit entries, and the
routes of what is not kept answer 409 naming the setting. One server of its own (module scope)."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import tempfile
from pathlib import Path

import httpx
import pytest

from dsec.config import Paths
from dsec.testing.isolated import ServerProcess, cleanup_home, link_node_downloads


@pytest.fixture(scope="module")
def off_server(server):     # `server`: the session's images and downloads exist
    home = Path(tempfile.mkdtemp(prefix="dsec-test-obs-off-", dir="/var/tmp"))
    link_node_downloads(home, server.home / "cache")
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService
    paths = Paths(home)
    paths.ensure()
    ensure_builtin(ImageService(paths), "busybox")
    # usage sampled every second if sampling ran: its absence shows within a few seconds
    srv = ServerProcess(home, env={"DSEC_OBSERVABILITY": "0", "DSEC_USAGE_IDLE_S": "1"})
    srv.start(120)
    yield srv
    srv.kill(signal.SIGTERM)
    cleanup_home(home)


def rows(db: Path, table: str) -> int:
    with sqlite3.connect(db) as con:
        try:
            return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        except sqlite3.OperationalError:     # never made: no rows
            return 0


async def test_observability_off_keeps_nothing(off_server):
    srv = off_server
    auth = {"Authorization": f"Bearer {srv.key}"}
    async with srv.client() as c:
        sb = await c.create_container(image="busybox", cpu_cores=0.1, memory_mb=16)
        try:
            assert (await sb.run("echo hi")).stdout == "hi\n"
            await asyncio.sleep(3.5)      # > 3 idle-sampling ticks (and 3 event pulls) had it been on
            samples = await sb.metrics()  # read on demand: still answered
            assert 1 <= len(samples) <= 2, f"sampled in the background: {len(samples)} samples"
        finally:
            await sb.stop()
    async with httpx.AsyncClient(base_url=srv.url, headers=auth, timeout=30) as h:
        text = (await h.get("/metrics")).text
        assert "DSEC_OBSERVABILITY=0" in text and "dsec_sandbox_creates" not in text
        for method, path in (("GET", "/v1/events"), ("GET", "/v1/audit"), ("GET", "/v1/webhooks"),
                             ("POST", "/v1/webhooks"), ("GET", "/e2b/events/sandboxes")):
            r = await h.request(method, path, json={"url": "https://example.com/hook"} if method == "POST" else None)
            assert r.status_code == 409, (path, r.status_code, r.text)
            err = r.json()["error"]
            assert err["field"] == "DSEC_OBSERVABILITY" and "DSEC_OBSERVABILITY" in err["fix"], err
        # a caller without a key still gets 401 first
        async with httpx.AsyncClient(base_url=srv.url) as anon:
            assert (await anon.get("/v1/events")).status_code == 401
    assert rows(srv.paths.edge_db, "events") == 0
    assert rows(srv.paths.iam_db, "audit_log") == 0
    assert rows(srv.paths.iam_db, "events") == 0
