"""Attacks on the park to disk (D44): a container parked to disk is started again over the
upper dir its own root wrote, so whatever root inside plants there meets the start: a symlink
where the agent's bind mount goes, a /dev entry, files where the run dir's names are."""

from __future__ import annotations

from pathlib import Path

from dsec.backends.container.hibernate import on_disk


async def test_symlinked_agent_dir_does_not_steer_the_start_again(cx, server, host_canary):
    sb = await cx.create_container(image="busybox")
    try:
        target = host_canary.parent          # a host directory the link aims at
        # /.dsec holds the agent's bind mount: renaming it is refused (EBUSY) while it runs; if
        # a kernel allowed it, the link must still not steer the bind mount out of the root
        await sb.run(f"mv /.dsec /.dsec-old && ln -s ../../../../..{target} /.dsec", user="root")
        moved = (await sb.run("test -L /.dsec")).exit_code == 0
        await sb.suspend()
        run = server.paths.sandboxes / sb.id / "run"
        assert on_disk(run)
        info = await sb.resume()
        # the bind of the agent went inside the sandbox's root, never to the host directory
        assert not (target / "agent").exists()
        if not moved:
            assert info.state.value == "running"
        if info.state.value == "running":
            out = (await sb.run("cat /proc/self/uid_map", user="root")).stdout
            assert out.split()[1] != "0", out                  # still in its own user namespace
    finally:
        await sb.stop()


async def test_planted_spec_names_in_the_sandbox_change_nothing(cx, server):
    """Files named like the run dir's, anywhere in the sandbox, are the sandbox's own: the
    start again reads the host-side run dir only."""
    sb = await cx.create_container(image="busybox")
    try:
        evil = '{"sandbox_id": "x", "lower_dirs": ["/"], "cpu_cores": 64, "memory_mb": 999999}'
        await sb.run(f"for d in / /work /tmp /run; do echo '{evil}' > $d/spec.json; echo '{{\"to_disk\": true}}' "
                     f"> $d/parked; done", user="root")
        await sb.suspend()
        await sb.resume()
        mem = Path("/sys/fs/cgroup/memory/dsec") / sb.id / "memory.limit_in_bytes"
        if mem.exists():
            assert int(mem.read_text()) == sb.info.memory_mb << 20
        assert (await sb.run("echo ok")).stdout == "ok\n"
    finally:
        await sb.stop()
