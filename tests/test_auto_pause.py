"""Auto-pause (on_timeout='pause'): the end of the lifetime parks the sandbox instead of ending
it, and its next request resumes it with a fresh lifetime. Real containers, real reaper."""

from __future__ import annotations

from conftest import wait_file

from dsec import ContainerArgs
from dsec.testing.waiting import wait_until

CYCLES = 10


async def _paused(sb) -> bool:
    info = await sb.refresh()          # GET reads the record: it does not resume the sandbox
    assert info.state.value in ("running", "suspended"), info
    return info.state.value == "suspended"


async def test_ten_pause_resume_cycles_keep_process_files_and_env(client):
    sb = await client.create_container(ContainerArgs(image="busybox", lifetime_s=1, on_timeout="pause",
                                                     ttl_idle_s=600, env={"MARK": "kept-env"}))
    try:
        assert sb.info.on_timeout == "pause" and sb.info.expires_at is not None
        await sb.start("sh -c 'echo $$ > /tmp/bg.pid; while :; do sleep 1; done'")
        pid = (await wait_file(sb, "/tmp/bg.pid")).strip()
        await sb.run("echo 0 > /work/log")
        for i in range(1, CYCLES + 1):
            await wait_until(lambda: _paused(sb), timeout_s=60, every_s=0.2, what=f"auto-pause {i}")
            assert sb.info.expires_at is None          # the lifetime that ended is gone while parked
            # the request resumes it: the same process, files and env
            r = await sb.run(f"kill -0 {pid} && echo $MARK && echo {i} >> /work/log && tail -n1 /work/log")
            assert r.exit_code == 0 and r.stdout == f"kept-env\n{i}\n", (i, r)
            info = await sb.refresh()
            assert info.state.value in ("running", "suspended")
        log = (await sb.run("cat /work/log")).stdout.split()
        assert log == [str(i) for i in range(CYCLES + 1)]
    finally:
        await sb.stop()


async def test_on_timeout_stop_still_ends_it(client):
    sb = await client.create_container(ContainerArgs(image="busybox", lifetime_s=1))
    assert sb.info.on_timeout == "stop"

    async def ended() -> bool:
        return (await sb.refresh()).state.value == "stopped"
    await wait_until(ended, timeout_s=60, every_s=0.2, what="the lifetime to stop it")
    assert "lifetime" in (sb.info.error or "")


async def test_a_quiescent_sandbox_paused_at_its_timeout_comes_back_with_its_files(client):
    """Nothing but the agent runs: the timeout parks it to disk (D44), the next request starts
    it again over its files."""
    sb = await client.create_container(ContainerArgs(image="busybox", lifetime_s=1, on_timeout="pause"))
    try:
        await sb.run("echo kept > /work/f")
        await wait_until(lambda: _paused(sb), timeout_s=60, every_s=0.2, what="auto-pause")
        r = await sb.run("cat /work/f")
        assert r.stdout == "kept\n", r
    finally:
        await sb.stop()
