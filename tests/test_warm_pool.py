"""Warm pools (edge/warm_pool.py, backends/container/claim.py, D28): a create that matches a
pool's key claims an idle pre-started container and gets the caller's own id, project, labels,
env, TTL, lifetime and cgroup limits, on a filesystem nobody used; pools refill in the
background; other requests create normally; an edge restart keeps claimed sandboxes and leaks
no pool container; one tenant's claimed container sees nothing of another's."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import httpx
import pytest

from conftest import ServerProc, side_server
from dsec.backends.container import cgroups
from dsec.backends.container.hibernate import on_disk
from dsec.backends.container.spec import cgroup_path
from dsec.edge.warm_pool import parse_targets
from dsec.bench.warm_fill import wait_full
from dsec.sdk.client import Client
from dsec.types import Forbidden, InvalidArgument, WarmPool, WarmPools, node_of
from dsec.testing.waiting import wait_until

POOL = "busybox:2"
START_S = 180      # a server start takes ~50 s when the shared box is loaded


def _crun_ids(server: ServerProc) -> set[str]:
    out = subprocess.run(["crun", "--root", str(server.paths.crun_root), "list", "-q"],
                         capture_output=True, text=True).stdout
    return set(out.split())


def _pool(server: ServerProc) -> dict:
    r = httpx.get(f"{server.url}/v1/nodes/local/warm-pool", headers={"Authorization": f"Bearer {server.key}"})
    r.raise_for_status()
    return r.json()


async def _wait_idle(server: ServerProc, image: str = "busybox", idle: int = 2, timeout_s: float = 60) -> dict:
    async def refilled() -> dict | None:
        st = await asyncio.to_thread(_pool, server)
        return st if st["pools"][image]["idle"] >= idle and st["pools"][image]["starting"] == 0 else None
    return await wait_until(refilled, timeout_s=timeout_s, every_s=0.2, what=f"pool {image} to refill to {idle}")


async def _pool_ids(server: ServerProc) -> set[str]:
    """Containers the runtime holds that no sandbox list shows: the idle pool's."""
    async with server.client() as c:
        live = {sb.id for sb in await c.list()}
    return _crun_ids(server) - live


def _limits(sandbox_id: str) -> dict[str, str]:
    rel = cgroup_path(sandbox_id)
    if cgroups.is_unified():
        d = cgroups.v2_dir(rel)
        return {f: (d / f).read_text().strip() for f in ("memory.max", "cpu.max", "cpu.weight", "pids.max")}
    files = {"memory": ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.kmem.tcp.limit_in_bytes"],
             "cpu": ["cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.shares"], "pids": ["pids.max"]}
    out = {}
    for ctl, names in files.items():
        for f in names:
            p = cgroups.v1_dir(ctl, rel) / f
            if p.exists():
                out[f] = p.read_text().strip()
    return out


@pytest.fixture(scope="module")
def pool_server(images, dsec_home, tmp_path_factory):
    """A server on its own home with a warm pool of 2 busybox containers."""
    with side_server(dsec_home, tmp_path_factory, "warmpool", {"DSEC_WARM_POOL": POOL}, start_timeout_s=START_S) as srv:
        yield srv


def test_pool_config_is_checked():
    assert [(t.image, t.size) for t in parse_targets("debian-python:8, busybox:4,busybox@v2:1")] == \
        [("debian-python", 8), ("busybox", 4), ("busybox@v2", 1)]
    for bad, word in (("busybox:x", "size"), ("busybox:5000", "outside"), ("/etc:1", "image name")):
        with pytest.raises(InvalidArgument) as e:
            parse_targets(bad)
        assert e.value.field == "DSEC_WARM_POOL" and word in e.value.message and e.value.fix


async def test_claim_gets_the_callers_settings_and_limits(pool_server):
    await _wait_idle(pool_server)
    pooled = await _pool_ids(pool_server)
    assert len(pooled) == 2
    policy = {"rules": [{"cidr": "10.0.0.5", "ports": [443], "protocol": "tcp"}]}
    settings = dict(cpu_cores=0.5, memory_mb=300, pids_limit=77, env={"GREETING": "hi"},
                    labels={"team": "rl"}, ttl_idle_s=123, lifetime_s=900, network=policy)
    async with pool_server.client() as c:
        sb = await c.create_container(image="busybox", **settings)
        # not claimable: another workdir is baked into the agent's command line at start
        ref = await c.create_container(image="busybox", workdir="/elsewhere", **settings)
        try:
            assert sb.id in pooled and ref.id not in pooled
            assert node_of(sb.id) == "local"
            info = await sb.refresh()
            assert (info.labels, info.cpu_cores, info.memory_mb, info.ttl_idle_s) == ({"team": "rl"}, 0.5, 300, 123)
            assert info.expires_at is not None and info.state.value == "running"
            assert info.project == ref.info.project                    # the caller's, not the pool's
            assert (await sb.run("echo $GREETING; pwd")).stdout == "hi\n/work\n"
            # its egress policy is applied: plugged in (a veth beside lo) like the ordinary create
            assert info.network is not None and info.network.model_dump() == ref.info.network.model_dump()
            ifaces = "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' ' | sort"
            assert (await sb.run(ifaces)).stdout.split() == (await ref.run(ifaces)).stdout.split() != ["lo"]
            # the cgroup limits crun wrote for an ordinary create are the ones the claim wrote
            lim = _limits(sb.id)
            assert lim == _limits(ref.id), (lim, _limits(ref.id))
            assert int(lim.get("memory.limit_in_bytes", lim.get("memory.max", 0))) == 300 << 20
            assert lim.get("pids.max") == "77"
            # inside: the memory limit holds (a 400 MiB allocation is killed, the sandbox lives on)
            r = await sb.run("head -c 400m /dev/zero | tail > /dev/null; echo rc=$?")
            assert "rc=0" not in r.stdout
            assert (await sb.run("echo alive")).stdout == "alive\n"
            # parked to disk and started again: with the claimed limits and policy, not the pool's
            await sb.suspend()
            assert on_disk(pool_server.paths.sandboxes / sb.id / "run")
            assert (await sb.run("echo $GREETING")).stdout == "hi\n"
            assert _limits(sb.id) == _limits(ref.id)
            assert (await sb.run(ifaces)).stdout.split() == (await ref.run(ifaces)).stdout.split()
            # the pool refills the one taken
            st = await _wait_idle(pool_server)
            assert st["claims"] >= 1
        finally:
            await sb.stop()
            await ref.stop()


async def test_a_request_that_does_not_match_creates_normally(pool_server):
    await _wait_idle(pool_server)
    pooled = await _pool_ids(pool_server)
    async with pool_server.client() as c:
        # below 256 MiB /dev/shm and the agent's output bound differ: not this pool's key
        small = await c.create_container(image="busybox", memory_mb=128)
        other = await c.create_container(image="debian-python")     # no pool for this image
        try:
            assert small.id not in pooled and other.id not in pooled
            assert await _pool_ids(pool_server) == pooled            # nothing taken
        finally:
            await small.stop()
            await other.stop()


async def test_claimed_sandbox_sees_its_own_size(pool_server):
    """D50: the claimer's cores and memory, not the pool's, in nproc, /proc/cpuinfo and
    /proc/meminfo (the cpuset is written at claim; lxcfs reads the limits live)."""
    await _wait_idle(pool_server)
    pooled = await _pool_ids(pool_server)
    size = "nproc; grep -c ^processor /proc/cpuinfo; head -1 /proc/meminfo"
    cpus = len(os.sched_getaffinity(0))
    async with pool_server.client() as c:
        for cores, mb in ((2, 700), (1, 300)):
            sb = await c.create_container(image="busybox", cpu_cores=cores, memory_mb=mb)
            try:
                assert sb.id in pooled
                want = min(cores, cpus)
                assert (await sb.run(size)).stdout.split() == [str(want), str(want), "MemTotal:", str(mb << 10), "kB"]
            finally:
                await sb.stop()


async def test_claimed_filesystem_is_clean_and_tenants_do_not_see_each_other(pool_server):
    await _wait_idle(pool_server)
    async with pool_server.client() as c:
        a = await c.create_container(image="busybox")
        await a.files.write("/work/secret.txt", b"tenant a")
        await a.run("echo a > /tmp/a; sleep 600 >/dev/null 2>&1 &")
        b = await c.create_container(image="busybox")      # the pool's other one, alive beside a
        try:
            r = await b.run("cat /work/secret.txt /tmp/a 2>&1; cat /proc/self/mountinfo")
            assert "tenant a" not in r.stdout and "No such file" in r.stdout
            assert a.id not in r.stdout                        # no path of a's bundle mounted in b
            assert "sleep" not in (await b.run("ps -o comm")).stdout
        finally:
            await b.stop()
        await a.stop()
        await _wait_idle(pool_server)
        again = await c.create_container(image="busybox")     # a fresh pool container, never used
        try:
            assert again.id not in (a.id, b.id)
            listing = (await again.run("ls -A /work /tmp")).stdout.split()
            assert "secret.txt" not in listing and "a" not in listing, listing
            assert (await again.run("test -e /work/secret.txt || test -e /tmp/a")).exit_code != 0
        finally:
            await again.stop()


async def test_admin_routes(pool_server):
    url = f"{pool_server.url}/v1/nodes/local/warm-pool"
    admin = {"Authorization": f"Bearer {pool_server.key}"}
    async with httpx.AsyncClient() as h:
        r = await h.put(url, json={"pools": "busybox:x"}, headers=admin)
        assert r.status_code == 422 and r.json()["error"]["field"] == "pools", r.text
        from conftest import stranger_key
        r = await h.get(url, headers={"Authorization": f"Bearer {stranger_key(pool_server, 'wp')}"})
        assert r.status_code == 403
        r = await h.put(url, json={"pools": "busybox:1"}, headers=admin)
        assert r.status_code == 200 and r.json()["pools"]["busybox"]["size"] == 1
        deadline = time.monotonic() + 30
        while len(await _pool_ids(pool_server)) != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert len(await _pool_ids(pool_server)) == 1          # drained to the new size
        r = await h.put(url, json={"pools": POOL}, headers=admin)
        assert r.status_code == 200
    await _wait_idle(pool_server)


async def test_sdk_reads_and_sets_the_pools(pool_server):
    """Client.warm_pools / set_warm_pools: the admin route, typed; refusals as the SDK's errors."""
    from conftest import stranger_key
    await _wait_idle(pool_server)
    async with pool_server.client() as c:
        st = await c.warm_pools()
        assert isinstance(st, WarmPools) and isinstance(st.pools["busybox"], WarmPool)
        assert st.pools["busybox"].size == 2 and st.pools["busybox"].full and st.claims >= 0
        with pytest.raises(InvalidArgument) as e:
            await c.set_warm_pools("busybox:x")
        assert e.value.field == "pools"
        try:
            st = await c.set_warm_pools("busybox:1")
            assert st.pools["busybox"].size == 1
            waited, error = await wait_full(c, "busybox", 1, 60)     # the benches' wait
            assert waited is not None and error is None
            assert (await c.warm_pools()).pools["busybox"].idle == 1
        finally:
            await c.set_warm_pools(POOL)
    async with Client(pool_server.url, stranger_key(pool_server, "wps"), autostart=False) as other:
        with pytest.raises(Forbidden):
            await other.warm_pools()
        with pytest.raises(Forbidden):
            await other.set_warm_pools("")
    await _wait_idle(pool_server)


async def test_edge_restart_keeps_claimed_sandboxes_and_leaks_no_pool_container(pool_server):
    await _wait_idle(pool_server)
    async with pool_server.client() as c:
        sb = await c.create_container(image="busybox", labels={"keep": "1"})
        await sb.files.write("/work/kept.txt", b"kept")
    await _wait_idle(pool_server)               # refilled after the claim
    old_pool = await _pool_ids(pool_server)
    assert len(old_pool) == 2 and sb.id not in old_pool
    pool_server.kill(signal.SIGKILL)            # a crash: the idle pool containers are orphans now
    pool_server.start(timeout_s=START_S)
    await _wait_idle(pool_server)
    async with pool_server.client() as c:
        again = await c.get(sb.id)
        assert again.info.state.value == "running" and again.info.labels == {"keep": "1"}
        assert (await again.files.read("/work/kept.txt")) == b"kept"
        new_pool = await _pool_ids(pool_server)
        assert len(new_pool) == 2 and not (new_pool & old_pool)      # the old ones were destroyed
        for sid in old_pool:
            assert cgroups.leftover_dirs(cgroup_path(sid)) == []
            assert not (pool_server.paths.sandboxes / sid).exists()
    pool_server.kill(signal.SIGTERM)            # an orderly stop: the pool (a cache) is destroyed
    assert _crun_ids(pool_server) == {sb.id}
    pool_server.start(timeout_s=START_S)
    await _wait_idle(pool_server)
    async with pool_server.client() as c:
        await (await c.get(sb.id)).stop()
