"""CPU QoS classes (ContainerArgs.cpu_class, backends/container/qos.py): a batch sandbox's
processes are SCHED_IDLE in a cgroup of minimum weight and cannot climb back; a latency one
keeps the normal policy and a weight proportional to its cores. Real containers."""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

import httpx
import pytest

from dsec.backends.container import cgroups, qos
from dsec.backends.container.spec import cgroup_path

# the policies of this process (a command) and of PID 1 (the agent), as numbers
POLICIES = "python3 -c 'import os; print(os.sched_getscheduler(0), os.sched_getscheduler(1))'"
# the policy of the `sleep` another command started (found by name in the sandbox's /proc)
SLEEPER_POLICY = ("import os, time\n"
                  "for _ in range(100):\n"
                  "    p = [int(d) for d in os.listdir(\"/proc\") if d.isdigit() and "
                  "open(f\"/proc/{d}/comm\").read().strip() == \"sleep\"]\n"
                  "    if p: break\n"
                  "    time.sleep(0.05)\n"
                  "print(os.sched_getscheduler(p[0]))")
# what a command may try to get back to the normal policy (or better); prints what happened
ESCAPE = r"""
import os, resource
for name, pol in (("other", os.SCHED_OTHER), ("batch", os.SCHED_BATCH), ("fifo", os.SCHED_FIFO)):
    try:
        os.sched_setscheduler(0, pol, os.sched_param(1 if pol == os.SCHED_FIFO else 0))
        print(name, "ALLOWED")
    except OSError as e:
        print(name, "denied", e.errno)
try:
    resource.setrlimit(resource.RLIMIT_NICE, (20, 20))
    print("rlimit ALLOWED")
except (OSError, ValueError) as e:
    print("rlimit denied")
print("nice-limit", resource.getrlimit(resource.RLIMIT_NICE), "policy", os.sched_getscheduler(0))
"""


def _agent_pid(server, sid: str) -> int:
    return int((server.paths.sandboxes / sid / "run" / "pid").read_text())


def _cpu_file(sid: str, name: str) -> str:
    d = cgroups.v2_dir(cgroup_path(sid)) if cgroups.is_unified() else cgroups.v1_dir("cpu", cgroup_path(sid))
    return (d / name).read_text().strip()


def _tasks(sid: str) -> list[int]:
    f = (cgroups.v2_dir(cgroup_path(sid)) / "cgroup.threads") if cgroups.is_unified() else \
        cgroups.v1_dir("cpu", cgroup_path(sid)) / "tasks"
    return [int(t) for t in f.read_text().split()]


def _idle_all(sid: str) -> dict[int, str]:
    """Policy of every thread in the sandbox's cgroup, by host tid."""
    out = {}
    for t in _tasks(sid):
        try:
            out[t] = qos.policy(t)
        except ProcessLookupError:
            pass
    return out


async def _assert_batch(server, sb) -> None:
    assert qos.policy(_agent_pid(server, sb.id)) == "idle"
    r = await sb.run(POLICIES)
    assert r.exit_code == 0 and r.stdout.split() == [str(os.SCHED_IDLE)] * 2, r
    # a background command (below its supervisor) and everything in the cgroup: all SCHED_IDLE
    bg = await sb.start("sleep 30")
    try:
        r = await sb.run(f"python3 -c '{SLEEPER_POLICY}'")
        assert r.exit_code == 0 and r.stdout.split() == [str(os.SCHED_IDLE)], r
        policies = _idle_all(sb.id)
        assert len(policies) >= 3 and set(policies.values()) == {"idle"}, policies   # agent, supervisor, sleep
    finally:
        await sb.signal(bg.exec_id, signal.SIGKILL)


async def test_batch_sandbox_is_sched_idle_with_minimum_weight(client, server):
    sb = await client.create_container(image="debian-python", cpu_class="batch", cpu_cores=1.5)
    try:
        assert sb.info is not None
        if cgroups.is_unified():
            assert _cpu_file(sb.id, "cpu.idle") == "1" and _cpu_file(sb.id, "cpu.weight") == "1"
        else:
            assert _cpu_file(sb.id, "cpu.shares") == "2"
            # the CFS quota is what cpu_cores says, whatever the class
            assert _cpu_file(sb.id, "cpu.cfs_quota_us") == "150000"
        await _assert_batch(server, sb)
    finally:
        await sb.stop()


async def test_latency_sandbox_keeps_normal_policy_and_proportional_weight(client, server):
    sb = await client.create_container(image="debian-python", cpu_cores=0.5)   # cpu_class="latency"
    try:
        assert qos.policy(_agent_pid(server, sb.id)) == "other"
        r = await sb.run(POLICIES)
        assert r.stdout.split() == [str(os.SCHED_OTHER)] * 2, r
        if not cgroups.is_unified():
            assert _cpu_file(sb.id, "cpu.shares") == "512"
            assert _cpu_file(sb.id, "cpu.cfs_quota_us") == "50000"
    finally:
        await sb.stop()


def test_bad_cpu_class_is_422_naming_it(server):
    r = httpx.post(server.url + "/v1/sandboxes", json={"image": "busybox", "cpu_class": "realtime"},
                   headers={"Authorization": f"Bearer {server.key}"}, timeout=30)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"].split(".")[0] == "cpu_class" and err["message"] and err["fix"]


@pytest.mark.parametrize("user", [None, "root"])
async def test_batch_sandbox_cannot_raise_its_priority_back(client, server, user):
    """Leaving SCHED_IDLE needs CAP_SYS_NICE in the initial user namespace or RLIMIT_NICE >= 20:
    the sandbox has neither, and its root cannot raise the hard limit (no CAP_SYS_RESOURCE)."""
    sb = await client.create_container(image="debian-python", cpu_class="batch", user=user)
    try:
        await sb.files.write("/tmp/escape.py", ESCAPE)
        r = await sb.run("python3 /tmp/escape.py")
        assert r.exit_code == 0, r
        assert "ALLOWED" not in r.stdout, r.stdout
        assert f"nice-limit (0, 0) policy {os.SCHED_IDLE}" in r.stdout, r.stdout
        assert qos.policy(_agent_pid(server, sb.id)) == "idle"
    finally:
        await sb.stop()


async def test_batch_class_survives_parking_and_edge_restart(client, server):
    sb = await client.create_container(image="debian-python", cpu_class="batch")
    sid = sb.id
    try:
        await sb.suspend()
        assert (await sb.refresh()).state.value == "suspended"
        await sb.resume()
        await _assert_batch(server, sb)           # thawed: same processes, same policy; new commands too
    except BaseException:
        await sb.stop()
        raise
    server.kill(signal.SIGKILL)
    server.start()
    async with server.client() as c:
        sb2 = await c.get(sid)
        try:
            assert sb2.info.state.value == "running"
            await _assert_batch(server, sb2)      # nothing redone by the restarted edge: nothing needed
        finally:
            await sb2.stop()


async def test_core_scheduling_cookie_for_latency_sandboxes(client, server):
    if not qos.core_sched_supported():
        pytest.skip("no core scheduling on this kernel (CONFIG_SCHED_CORE unset or no SMT): "
                    "latency sandboxes get no cookie here (docs/decisions.md D27)")
    sb = await client.create_container(image="busybox")
    try:
        cookie = ctypes.c_ulong(0)
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(qos.PR_SCHED_CORE, qos.PR_SCHED_CORE_GET, _agent_pid(server, sb.id),
                          qos.PIDTYPE_PID, ctypes.byref(cookie)) == 0
        assert cookie.value != 0
    finally:
        await sb.stop()


def test_spec_of_each_class():
    from dsec.backends.container.spec import ContainerSpec, build_config
    def spec(**kw: str) -> ContainerSpec:
        return ContainerSpec(sandbox_id="x", lower_dirs=[], cpu_cores=2.0, memory_mb=256, pids_limit=64, uid=1000,
                             gid=1000, workdir="/work", **kw)
    lat = build_config(spec(), Path("/bin/true"), cgroup_v2=False)
    bat = build_config(spec(cpu_class="batch"), Path("/bin/true"), cgroup_v2=False)
    assert lat["linux"]["resources"]["cpu"] == {"quota": 200000, "period": 100000, "shares": 2048}
    assert bat["linux"]["resources"]["cpu"] == {"quota": 200000, "period": 100000, "shares": 2}
    limits = {r["type"]: (r["soft"], r["hard"]) for r in bat["process"]["rlimits"]}
    assert limits["RLIMIT_NICE"] == (0, 0) and limits["RLIMIT_RTPRIO"] == (0, 0)
    assert "RLIMIT_NICE" not in {r["type"] for r in lat["process"]["rlimits"]}


async def test_tiny_request_gets_the_quota_floor_and_a_proportional_weight(client):
    """cpu_cores=0.005: the weight stays the request's (5 shares), the quota is the node's floor
    (0.1 core = 10 ms per period), so one `exec true` is not stretched over several periods."""
    sb = await client.create_container(image="busybox", cpu_cores=0.005, memory_mb=48)
    try:
        if not cgroups.is_unified():
            assert _cpu_file(sb.id, "cpu.shares") == "5"
            assert _cpu_file(sb.id, "cpu.cfs_quota_us") == "10000"
            assert _cpu_file(sb.id, "cpu.cfs_period_us") == "100000"
        assert (await sb.run("true")).exit_code == 0
    finally:
        await sb.stop()


def test_quota_floor_is_an_operator_setting():
    from dsec.settings import ContainerSettings
    from dsec.types import InvalidArgument

    def floor(value: str) -> float:
        return ContainerSettings.from_env({"DSEC_CPU_QUOTA_FLOOR_CORES": value}).cpu_quota_floor_cores
    assert qos.cpu_quota_us(0.005, floor("0.02")) == 2000 and qos.cpu_quota_us(1.5, floor("0.02")) == 150000
    assert qos.cpu_quota_us(0.005, floor("0")) == 1000          # the kernel's minimum
    assert qos.cpu_quota_us(0.005) == 10000                     # the default floor, 0.1 core
    for bad in ("lots", "65"):
        with pytest.raises(InvalidArgument) as e:
            floor(bad)
        assert e.value.field == "DSEC_CPU_QUOTA_FLOOR_CORES" and "0.1" in (e.value.fix or "")
