"""The stock e2b SDK's get_metrics (GET /sandboxes/{id}/metrics, /sandboxes/metrics) against
dsec's per-sandbox usage samples (edge/usage.py); another project's sandbox is not found."""

from __future__ import annotations

import datetime
import time

import httpx
import pytest
from conftest import stranger_key

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import Sandbox
from e2b.exceptions import NotFoundException, SandboxException


def test_get_metrics_of_a_busy_sandbox(e2b_env):
    sbx = Sandbox.create("debian-python", timeout=120)
    try:
        sbx.commands.run("sh -c 'while true; do :; done' >/dev/null 2>&1 &")
        time.sleep(1.5)
        metrics = sbx.get_metrics()
        assert metrics, "no samples"
        m = metrics[-1]
        assert m.cpu_count >= 1 and m.cpu_used_pct > 20, m
        assert 0 < m.mem_used <= m.mem_total and m.mem_cache >= 0
        assert m.disk_total >= m.disk_used >= 0
        assert isinstance(m.timestamp, datetime.datetime)
        assert Sandbox.get_metrics(sbx.sandbox_id)       # the class-method form
        future = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
        assert sbx.get_metrics(start=future) == []
        # the batch route: latest sample per sandbox of the caller's
        r = httpx.get(f"{e2b_env}/sandboxes/metrics", params={"sandbox_ids": f"{sbx.sandbox_id},nope"},
                      headers={"X-API-KEY": sbx.connection_config.api_key}, timeout=30)
        assert r.status_code == 200 and list(r.json()["sandboxes"]) == [sbx.sandbox_id]
        assert r.json()["sandboxes"][sbx.sandbox_id]["memTotal"] == m.mem_total
    finally:
        sbx.kill()
    with pytest.raises((NotFoundException, SandboxException)):
        Sandbox.get_metrics(sbx.sandbox_id)


def test_metrics_of_another_projects_sandbox_are_not_found(e2b_env, server):
    sbx = Sandbox.create("busybox", timeout=120)
    try:
        other = stranger_key(server, "e2b-metrics")
        with pytest.raises((NotFoundException, SandboxException)) as e:
            Sandbox.get_metrics(sbx.sandbox_id, api_key=other)
        assert "not found" in str(e.value).lower()
        r = httpx.get(f"{e2b_env}/sandboxes/metrics", params={"sandbox_ids": sbx.sandbox_id},
                      headers={"X-API-KEY": other}, timeout=30)
        assert r.status_code == 200 and r.json() == {"sandboxes": {}}
    finally:
        sbx.kill()
