"""Prometheus metrics (dsec/metrics.py) and per-sandbox usage (edge/usage.py) against a real
server: /metrics for the admin only, a project's own series, counters that move, bounded
label sets, sb.metrics() of a busy sandbox, `dsec sandbox top --once`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest
from conftest import stranger_key

from dsec.sdk.client import Client
from dsec.types import SANDBOX_ID_RE, DsecError

pytest.importorskip("prometheus_client", reason="pip install -e '.[server]' (prometheus-client)")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ALLOWED_LABELS = {"project", "backend", "outcome", "stage", "reason", "kind", "node", "state", "parked",
                  "resource", "image", "of", "result", "le", "infrastructure"}


def small_project_key(server) -> str:
    """A key of a new project whose memory quota is 64 MiB."""
    from dsec.iam import IAM
    with IAM(server.paths.iam_db) as iam:
        p = iam.create_project(f"metrics-small-{os.urandom(4).hex()}", iam.root().id)
        iam.set_quota(p.id, max_memory_mb=64)
        return iam.create_key(p.id)


def scrape(server, key: str, path: str = "/metrics") -> httpx.Response:
    return httpx.get(server.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(text: str, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples(text).items()
               if n == name and all((k, val) in ls for k, val in labels.items()))


async def test_metrics_admin_only_and_counters_move(server, client):
    before = scrape(server, server.key)
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    sb = await client.create_container(image="busybox")
    try:
        await sb.run("true")
        async with Client(server.url, small_project_key(server)) as small:
            with pytest.raises(DsecError) as refused:   # over its project's memory quota
                await small.create_container(image="busybox", memory_mb=256)
        assert refused.value.status == 429
        after = scrape(server, server.key).text
    finally:
        await sb.stop()
    b = before.text
    for name, labels in (("dsec_sandbox_creates_total", {"outcome": "ok", "backend": "container"}),
                         ("dsec_execs_total", {"kind": "run"}),
                         ("dsec_exec_seconds_count", {"backend": "container"}),
                         ("dsec_placements_total", {"outcome": "placed"})):
        assert total(after, name, **labels) > total(b, name, **labels), name
    assert total(after, "dsec_admission_refusals_total", reason="quota") == \
        total(b, "dsec_admission_refusals_total", reason="quota") + 1
    # histogram buckets of every create stage
    for stage in ("prepare", "admission", "slot", "start", "agent", "total"):   # slot: the start-slot wait
        assert total(after, "dsec_sandbox_create_seconds_bucket", stage=stage, le="+Inf") >= 1, stage
    assert total(after, "dsec_sandbox_create_seconds_bucket", stage="total", le="0.05") <= \
        total(after, "dsec_sandbox_create_seconds_bucket", stage="total", le="120.0")
    assert total(after, "dsec_sandboxes") >= 0 and "dsec_node_pressure_avg10" in after
    assert "dsec_warm_pool_lookups" in after and "dsec_node_committed_memory_mb" in after


def test_label_sets_are_bounded(server):
    """No label is a sandbox id; each label name is from the documented set (docs/metrics.md)."""
    text = scrape(server, server.key).text
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("dsec_"):
            continue
        for s in fam.samples:
            assert set(s.labels) <= ALLOWED_LABELS, (s.name, s.labels)
            for v in s.labels.values():
                assert not SANDBOX_ID_RE.search(v) and "sb-" not in v, (s.name, s.labels)


async def test_project_key_refused_node_metrics_gets_its_own(server):
    key = stranger_key(server, "metrics")
    r = scrape(server, key)
    assert r.status_code == 403 and r.json()["error"]["field"] == "Authorization"
    assert "/v1/metrics" in r.json()["error"]["fix"]
    async with Client(server.url, key) as c:
        sb = await c.create_container(image="busybox")
        try:
            await sb.run("true")
            mine = scrape(server, key, "/v1/metrics")
            node = scrape(server, key, "/v1/nodes/local/metrics")
        finally:
            await sb.stop()
    project = sb.info.project
    assert mine.status_code == 200 and total(mine.text, "dsec_sandbox_creates_total", outcome="ok") == 1
    for text in (mine.text, node.text):
        projects = {dict(ls).get("project") for (_, ls) in samples(text)}
        assert projects == {project}, projects      # nothing of the root's or others'
    admin_node = scrape(server, server.key, "/v1/nodes/local/metrics")
    assert admin_node.status_code == 200 and "dsec_node_pressure_avg10" in admin_node.text
    assert scrape(server, server.key, "/v1/nodes/nope/metrics").status_code == 404


async def test_sandbox_usage_of_a_busy_sandbox(client):
    """CPU > 0 while it spins; memory used near what it allocated, with its limit."""
    sb = await client.create_container(image="debian-python", memory_mb=512, cpu_cores=1)
    try:
        await sb.run("python3 -c \"import time; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
                     "open('/tmp/ready', 'w').write('1'); time.sleep(600)\" >/dev/null 2>&1 &", timeout_s=10)
        await sb.run("sh -c 'while true; do :; done' >/dev/null 2>&1 &", timeout_s=10)
        await sb.run("for i in $(seq 50); do [ -f /tmp/ready ] && exit 0; sleep 0.2; done; exit 1")
        await asyncio.sleep(1)
        all_ = await sb.metrics()
        s = all_[-1]
        assert s.cpu_used_pct > 20, all_
        assert s.cpu_count == 1 and s.mem_total == 512 << 20
        assert 190 << 20 <= s.mem_used <= 300 << 20, s
        assert s.disk_total >= 0 and s.disk_used >= 0
        first = (await sb.metrics())[0].timestamp
        assert await sb.metrics(start=first + 1e6) == []
    finally:
        await sb.stop()
    assert await sb.metrics() == []      # an ended sandbox keeps no samples (its record stays a day)


async def test_sandbox_top_once(server, client):
    sb = await client.create_container(image="busybox")
    try:
        await sb.metrics()
        env = {**os.environ, "DSEC_URL": server.url, "DSEC_API_KEY": server.key, "COLUMNS": "200"}
        r = subprocess.run([sys.executable, "-m", "dsec", "sandbox", "top", "--once", sb.id], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert sb.id in r.stdout and "cpu %" in r.stdout and "mem limit" in r.stdout
    finally:
        await sb.stop()


async def test_vm_usage(vm_client):
    """VM sandboxes: their QEMU's CPU time and resident memory, the limit, the disk files."""
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256)
    try:
        await sb.run("sh -c 'while true; do :; done' >/dev/null 2>&1 &", timeout_s=30)
        await asyncio.sleep(1.5)
        s = (await sb.metrics())[-1]
        assert s.cpu_used_pct > 20 and s.mem_total == 256 << 20 and 0 < s.mem_used, s
    finally:
        await sb.stop()


async def test_parked_sandboxes_by_where(server, client):
    """Parked sandboxes count as suspended, by where: on disk (only its agent ran: hibernated),
    in memory (a process of its own ran on: frozen in place)."""
    idle = await client.create_container(image="busybox")
    busy = await client.create_container(image="busybox")
    try:
        await busy.run("sleep 600 >/dev/null 2>&1 &")
        before = scrape(server, server.key).text
        await idle.suspend()
        await busy.suspend()
        text = scrape(server, server.key).text
        for where in ("disk", "memory"):
            assert total(text, "dsec_sandboxes", state="suspended", parked=where) == \
                total(before, "dsec_sandboxes", state="suspended", parked=where) + 1, (where, text)
    finally:
        await idle.stop()
        await busy.stop()
