"""Output pressure on one sandbox, through the real server (apiserver + edge + crun + the C agent):
results are freed once delivered, an agent killed by the OOM killer is reported as out of
memory, and concurrent execs with large output either complete or are refused with 429
(never lost), with the server's memory bounded."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from dsec.backends.container import cgroups
from dsec.backends.container.spec import cgroup_path

MB = 1_000_000


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def agent_pid(server, sandbox_id: str) -> int:
    return int((server.paths.sandboxes / sandbox_id / "run" / "pid").read_text())


def memory_file(sandbox_id: str, name: str) -> Path:
    rel = cgroup_path(sandbox_id).lstrip("/")
    if cgroups.is_unified():
        return cgroups.CGROUP_ROOT / rel / name
    return cgroups.CGROUP_ROOT / "memory" / rel / name


async def test_run_results_are_freed_in_a_small_sandbox(client, server):
    """40 run()s of 1 MB output each in a 32 MiB sandbox: each result is freed by the agent once
    delivered, so the agent never grows towards the sandbox's memory limit (it used to keep
    every result until it was OOM-killed, reported as a lost channel)."""
    async with await client.create_container(image="busybox", memory_mb=32) as sb:
        for i in range(40):
            r = await sb.run(f"head -c {MB} /dev/zero | tr '\\0' a; echo {i} >&2", timeout_s=30)
            assert r.exit_code == 0 and len(r.stdout) == MB and r.stderr == f"{i}\n", (i, r.stderr[-500:])
        info = await sb.refresh()
        assert info.state.value == "running", info.error
        # what the agent retains is small: no result is kept after delivery
        rss_kib = int((await sb.run("grep VmRSS /proc/1/status")).stdout.split()[1])
        assert rss_kib < 8 * 1024, f"agent RSS {rss_kib} KiB after 40 delivered results"


async def test_agent_killed_by_oom_is_reported_as_out_of_memory(client, server):
    """The OOM killer picks the agent (made its first choice from the host): the sandbox fails
    with a reason naming memory and the limit, not a lost channel."""
    sb = await client.create_container(image="busybox", memory_mb=32)
    try:
        pid = agent_pid(server, sb.id)
        # fill the sandbox's memory with tmpfs pages (charged to it, in no process's RSS, not
        # reclaimable without swap): the OOM killer kills the highest score, the agent, and the
        # sandbox ends with its init. The command's shell is forked before the agent's score is
        # raised: commands inherit the agent's oom_score_adj (/proc is read-only inside, D11)
        run = asyncio.create_task(sb.run("sleep 2; head -c 40000000 /dev/zero > /dev/shm/fill", timeout_s=30))
        await asyncio.sleep(1)
        Path(f"/proc/{pid}/oom_score_adj").write_text("1000")
        try:
            await run
        except Exception as e:      # the channel is lost when the agent dies mid-command
            assert "out of memory" in str(e) and "memory_mb=32" in str(e), e
        for _ in range(100):
            info = await sb.refresh()
            if info.state.value != "running":
                break
            await asyncio.sleep(0.1)
        assert info.state.value == "failed", info
        assert "out of memory" in (info.error or "") and "memory_mb=32" in (info.error or ""), info.error
    finally:
        await sb.stop()


async def test_parallel_large_outputs_complete_or_are_refused(client, server):
    """64 parallel /exec of ~2 MB output each in one sandbox, beside small echos: every exec
    either returns its complete result or is refused at once with 429 and Retry-After (and then
    completes when retried after it); none is lost or hangs; the echos all return; the server's
    memory stays bounded and the agent keeps nothing once the results are delivered."""
    size = 2_000_000
    big_cmd = f"head -c {size} /dev/zero | tr '\\0' b"
    async with await client.create_container(image="busybox") as sb, httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}, timeout=120,
            limits=httpx.Limits(max_connections=256)) as http:
        url = f"/v1/sandboxes/{sb.id}/exec"
        rss0 = peak = rss_mb(server.proc.pid)
        refused: list[str] = []

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rss_mb(server.proc.pid))
                await asyncio.sleep(0.05)

        async def small(i: int) -> str:
            r = await http.post(url, json={"cmd": f"sleep 1; echo small-{i}", "timeout_s": 60})
            assert r.status_code == 200, r.text
            return r.json()["stdout"]

        async def big(i: int) -> dict:
            for _ in range(120):
                r = await http.post(url, json={"cmd": f"{big_cmd}; echo {i} >&2", "timeout_s": 60,
                                                "output_cap_bytes": 2 << 20})
                if r.status_code != 429:
                    assert r.status_code == 200, r.text
                    return r.json()
                assert r.json()["error"]["code"] == "capacity_exceeded", r.text
                refused.append(r.headers["retry-after"])
                await asyncio.sleep(float(r.headers["retry-after"]))
            raise AssertionError(f"exec {i} refused 120 times")

        sampler = asyncio.create_task(sample())
        t0 = time.monotonic()
        try:
            smalls = [asyncio.create_task(small(i)) for i in range(8)]
            await asyncio.sleep(0.3)                     # the echos run first, the burst beside them
            results = await asyncio.wait_for(asyncio.gather(*(big(i) for i in range(64)), *smalls), 150)
        finally:
            sampler.cancel()
        bigs, outs = results[:64], results[64:]
        assert outs == [f"small-{i}\n" for i in range(8)]
        for i, r in enumerate(bigs):
            assert (r["exit_code"], r["truncated"], len(r["stdout"]), r["stderr"]) == (0, False, size, f"{i}\n")
        assert refused, "64 execs of 2 MiB output each were all admitted at once: no back-pressure"
        assert all(int(s) >= 1 for s in refused)
        growth = peak - rss0
        assert growth < 300, f"server RSS grew {growth:.0f} MiB (from {rss0:.0f}) for 64 x 2 MB results"
        # every result was delivered, so the agent keeps none of them
        agent_rss = rss_mb(agent_pid(server, sb.id))
        assert agent_rss < 8, f"agent RSS {agent_rss:.1f} MiB after all results were delivered"
        assert (await sb.run("echo still-fine")).stdout == "still-fine\n"
        print(f"64 x 2 MB: {time.monotonic() - t0:.1f}s, {len(refused)} refusals, server RSS +{growth:.0f} MiB")
