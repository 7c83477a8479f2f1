"""Containment defences against a hostile agent *inside* its own sandbox, tested on real
sandboxes (crun + the agent as PID 1): Landlock per command/session, kernel and agent paths
root cannot write, the writable-layer disk quota, per-command rlimits, the recursive-grep
hazard, signals to PID 1, and an overwritten /bin/bash staying in its sandbox.
See docs/decisions.md D11 and the Landlock section of insandbox/agent/base.c."""

from __future__ import annotations

import asyncio
import os
import time

import pytest


IMAGE = "debian-python"
# capability bits that would undo the isolation below: CAP_SYS_PTRACE (ptrace anything the
# uid/caps allow), CAP_SYS_ADMIN and CAP_PERFMON (since Linux 6.13 perfmon_capable() lets
# mm_access() read any process's environ/maps/mem, Landlock or not), CAP_MKNOD
FORBIDDEN_CAPS = {"CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21, "CAP_PERFMON": 38, "CAP_MKNOD": 27}


async def _cap_eff(sb) -> int:
    r = await sb.run("grep CapEff /proc/self/status")
    return int(r.stdout.split()[1], 16)


async def test_commands_and_sessions_cannot_reach_each_other(client):
    """Each exec and session is its own Landlock domain: no /proc/PID/{fd,environ,mem,maps}
    of a sibling, no ptrace, nothing of the agent; a command's own children stay reachable."""
    async with await client.create_container(image=IMAGE, user="root") as sb:
        caps = await _cap_eff(sb)
        assert not [n for n, bit in FORBIDDEN_CAPS.items() if caps >> bit & 1]
        r = await sb.run("echo $$", session="victim", env={"TOKEN": "s3cr3t-token"})
        victim = int(r.stdout.split()[-1])
        attack = f"""
            cat /proc/{victim}/environ && echo ENVIRON-LEAKED
            timeout 2 cat /proc/{victim}/fd/0; [ $? = 124 ] && echo INPUT-STOLEN
            timeout 2 cat /proc/{victim}/fd/1; [ $? = 124 ] && echo OUTPUT-STOLEN
            echo 'DSEC forged output' > /proc/{victim}/fd/1 && echo FORGED
            echo 'touch /tmp/injected' > /proc/{victim}/fd/0 && echo INJECTED
            head -c1 /proc/{victim}/maps && echo MAPS-READ
            readlink -v /proc/{victim}/cwd && echo CWD-READ
            cat /proc/1/environ && echo AGENT-ENVIRON
            readlink -v /proc/1/fd/3 && echo AGENT-FD
            python3 -c "
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
for pid in ({victim}, 1):
    if libc.ptrace(16, pid, 0, 0) == 0:    # PTRACE_ATTACH
        print('PTRACE-ATTACHED', pid)
    else:
        print('ptrace', pid, ctypes.get_errno(), file=sys.stderr)
"
            sleep 30 & sleep 0.2; cat /proc/$!/environ | tr '\\0' '\\n' | grep -c PATH   # own child: same domain
            kill $!
        """
        r = await sb.run(attack, timeout_s=30)
        for leak in ("ENVIRON-LEAKED", "INPUT-STOLEN", "OUTPUT-STOLEN", "FORGED", "INJECTED", "MAPS-READ",
                     "CWD-READ", "AGENT-ENVIRON", "AGENT-FD", "PTRACE-ATTACHED", "s3cr3t"):
            assert leak not in r.stdout, (leak, r.stdout, r.stderr)
        assert r.stderr.count("Permission denied") >= 9, r.stderr
        assert "ptrace 1 1" in r.stderr and f"ptrace {victim} 1" in r.stderr   # EPERM
        assert r.stdout.strip().endswith("1"), r.stdout   # its own child's environ is readable
        # the victim session is intact, nothing was injected into it or forged in its output
        r = await sb.run("echo $TOKEN; ls /tmp/injected 2>&1", session="victim")
        assert r.stdout.startswith("s3cr3t-token\n") and "No such file" in r.stdout and "forged" not in r.stdout
        # the same from a second session (sessions are separate domains too)
        r = await sb.run(f"cat /proc/{victim}/environ >/dev/null 2>&1 && echo LEAK; echo done", session="other")
        assert r.stdout == "done\n"


async def test_root_cannot_write_kernel_agent_or_device_paths(client):
    async with await client.create_container(image=IMAGE, user="root") as sb:
        for cmd in ("echo x > /proc/sys/kernel/hostname", "echo 1 > /sys/kernel/mm/ksm/run",
                    "echo x > /proc/self/comm", "cp /bin/true /.dsec/agent", "touch /.dsec/x",
                    "rm -f /dev/null", "echo x > /dev/evil", "mkdir /dev/evil", "ln -s /etc /dev/evil",
                    "mknod /tmp/mem c 1 1", "mknod /tmp/blk b 7 0", "cp /bin/true /dev/shm/t && /dev/shm/t"):
            r = await sb.run(cmd)
            assert r.exit_code != 0, (cmd, r)
        r = await sb.run("ls -l /dev/null; ls /.dsec; ls /dev")
        assert r.stdout.startswith("crw-rw-rw-") and "evil" not in r.stdout and "\nagent\n" in r.stdout
        # what must keep working for root
        r = await sb.run("echo ok > /dev/null && head -c4 /dev/urandom | wc -c && echo x > /dev/shm/f "
                         "&& mkfifo /tmp/fifo && mkdir -p /opt/a && mv /dev/shm/f /opt/a/ && cat /opt/a/f "
                         "&& python3 -c 'import pty; pty.openpty()' && echo fine", check=True)
        assert r.stdout == "4\nx\nfine\n"


async def test_root_writes_anywhere_in_its_rootfs_as_in_docker(client):
    """Issue 24 item 1: a Harbor solution's `mkdir -p /app` as root got EACCES (Landlock granted
    only the top-level entries that existed). Root may now create, write and remove entries
    directly in /, in the same command and in a session started before; what stays closed is
    closed by mounts: /proc, /sys, /dev and /.dsec read-only, /dev/shm noexec, no device nodes."""
    async with await client.create_container(image=IMAGE, user="root") as sb:
        await sb.run("cd /tmp", session="early")       # a session (its Landlock domain) from before
        r = await sb.run("mkdir -p /app && echo x > /app/f && touch /x /usr/local/bin/y && cat /app/f "
                         "&& mv /x /app/x2 && ls /app && rm -rf /app /x /usr/local/bin/y && echo done")
        assert (r.exit_code, r.stdout) == (0, "x\nf\nx2\ndone\n"), r
        r = await sb.run("mkdir -p /app/sub && echo early > /app/sub/f && cat /app/sub/f", session="early")
        assert (r.exit_code, r.stdout) == (0, "early\n"), r
        r = await sb.run("echo later >> /app/sub/f && cat /app/sub/f && ln -s /app /applink && ls /applink/sub")
        assert (r.exit_code, r.stdout) == (0, "early\nlater\nf\n"), r
        denied = {"mknod /dev/foo c 1 3": "Read-only", "mknod /app/mem c 1 1": "Permission denied",
                  "echo 1000 > /proc/1/oom_score_adj": "Read-only", "echo 0 > /proc/self/oom_score_adj": "Read-only",
                  "echo x > /proc/sys/kernel/hostname": "Read-only", "echo 1 > /sys/kernel/mm/ksm/run": "Read-only",
                  "touch /.dsec/x": "Read-only", "cp /bin/true /.dsec/agent": "",
                  "rm /dev/null": "Read-only", "mv /dev/null /dev/null2": "", "touch /dev/null2": "Read-only",
                  "cp /bin/true /dev/shm/t && /dev/shm/t": "Permission denied",
                  "ln -s /proc /procl && echo 1 > /procl/self/oom_score_adj": "Read-only",
                  "mv /proc /p": "busy", "mv /.dsec /d": "busy", "rmdir /sys": "busy"}
        for cmd, why in denied.items():
            r = await sb.run(cmd)
            assert r.exit_code != 0 and why in r.stderr, (cmd, r)
        r = await sb.run("ls -l /dev/null; ls -A /.dsec; ls /dev | grep -c null2; echo ok > /dev/null && echo fine")
        assert r.stdout.startswith("crw-rw-rw-") and r.stdout.endswith("\nagent\n0\nfine\n"), r
    async with await client.create_container(image=IMAGE) as sb:   # not root: the image's permissions
        r = await sb.run("mkdir /app")
        assert r.exit_code != 0 and "Permission denied" in r.stderr, r


async def test_disk_quota_hits_one_sandbox_only(client, server):
    if not os.path.ismount(server.paths.sandboxes):
        pytest.skip("no btrfs scratch filesystem on this host: quotas are polled (see server.log)")
    small, other = await asyncio.gather(client.create_container(image=IMAGE, user="root", disk_mb=64),
                                        client.create_container(image=IMAGE))
    try:
        fill = "dd if=/dev/zero of=/work/fill bs=1M count=200 status=none"
        r1, r2 = await asyncio.gather(small.run(fill), other.run(fill))
        assert r1.exit_code != 0 and ("Disk quota exceeded" in r1.stderr or "No space left" in r1.stderr), r1
        assert r2.exit_code == 0, r2      # the neighbour is unaffected
        # the full sandbox keeps running, reports the error to Python too, and recovers on delete
        r = await small.run("python3 -c \"open('/tmp/x', 'wb').write(b'x' * (1 << 20))\"")
        assert r.exit_code != 0 and "Errno 122" in r.stderr
        r = await small.run("rm /work/fill; dd if=/dev/zero of=/work/again bs=1M count=16 status=none && echo ok")
        assert r.stdout == "ok\n"
    finally:
        await asyncio.gather(small.stop(), other.stop())


async def test_polled_disk_quota_fallback_fails_the_sandbox(tmp_path_factory):
    """Where the kernel cannot enforce quotas (DSEC_DISK_QUOTA=poll here), the edge measures
    the writable layers and fails a sandbox beyond disk_mb, saying why."""
    import signal
    import tempfile
    from pathlib import Path

    from conftest import ServerProc, _cleanup_home, link_downloads
    from dsec.config import Paths
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService

    home = Path(tempfile.mkdtemp(prefix="dsec-test-poll-", dir="/var/tmp"))
    link_downloads(home)
    Paths(home).ensure()
    ensure_builtin(ImageService(Paths(home)), "busybox")
    srv = ServerProc(home, env={"DSEC_DISK_QUOTA": "poll", "DSEC_DISK_POLL_S": "0.2"})
    srv.start()
    try:
        assert not os.path.ismount(srv.paths.sandboxes)
        async with srv.client() as c:
            sb = await c.create_container(image="busybox", disk_mb=64)
            fine = await c.create_container(image="busybox", disk_mb=64)
            await sb.run("dd if=/dev/zero of=/work/fill bs=1M count=100")
            await fine.run("dd if=/dev/zero of=/work/some bs=1M count=8")
            deadline = time.monotonic() + 15
            while (info := (await c.get(sb.id)).info).state.value == "running" and time.monotonic() < deadline:
                await asyncio.sleep(0.3)
            assert info.state.value == "failed" and "disk quota exceeded" in (info.error or ""), info
            assert "disk_mb=64" in info.error
            assert (await fine.run("echo alive")).stdout == "alive\n"
            await fine.stop()
    finally:
        srv.kill(signal.SIGTERM)
        _cleanup_home(home)


async def test_rlimits_of_commands(client):
    async with await client.create_container(image=IMAGE, user="root") as sb:
        r = await sb.run("ulimit -Sn; ulimit -Hn; ulimit -c; ulimit -f")
        assert r.stdout.split() == ["4096", "4096", "0", "unlimited"]
        r = await sb.run("ulimit -n 8192")            # root without CAP_SYS_RESOURCE cannot raise it
        assert r.exit_code != 0
    async with await client.create_container(image=IMAGE, nofile=256, max_file_mb=1) as sb:
        r = await sb.run("python3 -c \"fs = [open('/dev/null') for _ in range(300)]\"")
        assert r.exit_code != 0 and "Too many open files" in r.stderr
        r = await sb.run("head -c 2M /dev/zero > /tmp/big; echo $?; stat -c %s /tmp/big")
        assert r.stdout.split()[-1] == str(1 << 20)    # cut at RLIMIT_FSIZE (SIGXFSZ / EFBIG)


async def test_recursive_grep_of_root_is_bounded(client):
    """kpage* are masked; what is left that never ends is /proc/PID/pagemap (8 bytes per page
    of a 128 TiB address space per process: minutes of reading, bounded by timeout_s and the
    sandbox's CPU quota, harmless to the node)."""
    async with await client.create_container(image=IMAGE, user="root", cpu_cores=1) as sb:
        r = await sb.run("wc -c < /proc/kpagecount; wc -c < /proc/kpageflags; wc -c < /proc/kpagecgroup")
        assert r.stdout.split() == ["0", "0", "0"]
        t0 = time.monotonic()
        r = await sb.run("grep -r x / --exclude=pagemap 2>/dev/null | wc -c", timeout_s=60)
        assert r.exit_code == 0 and int(r.stdout) > 1_000_000 and time.monotonic() - t0 < 30
        t0 = time.monotonic()
        r = await sb.run("grep -r x / 2>/dev/null | wc -c", timeout_s=8)
        assert r.timed_out and time.monotonic() - t0 < 15
        r = await sb.run("ps -eo args | grep -c '^grep -r' || true")
        assert r.stdout.strip() == "0"               # the whole tree was killed
    async with await client.create_container(image="busybox") as other:   # the node is fine
        assert (await other.run("echo alive")).stdout == "alive\n"


async def test_pid1_ignores_signals_from_inside(client):
    async with await client.create_container(image=IMAGE, user="root") as sb:
        r = await sb.run("for s in KILL TERM INT HUP QUIT USR1 STOP; do kill -s $s 1; done; sleep 0.2; echo sent")
        assert r.stdout == "sent\n"
        r = await sb.run("echo alive; cat /proc/1/comm; grep State /proc/1/status")
        lines = r.stdout.splitlines()
        assert lines[:2] == ["alive", "agent"] and "stopped" not in lines[2], r.stdout


async def test_overwritten_bash_stays_in_its_sandbox(client):
    a, b = await asyncio.gather(client.create_container(image=IMAGE, user="root"),
                                client.create_container(image=IMAGE, user="root"))
    try:
        r = await a.run("rm /bin/bash && printf '#!/bin/sh\\necho pwned\\n' > /bin/bash && chmod 755 /bin/bash")
        assert r.exit_code == 0, r
        assert (await a.run("echo hello")).stdout == "pwned\n"   # the agent runs /bin/bash -c
        assert (await b.run("echo hello")).stdout == "hello\n"   # same image, its own upper layer
        async with await client.create_container(image=IMAGE) as c:
            assert (await c.run("echo hello")).stdout == "hello\n"
    finally:
        await asyncio.gather(a.stop(), b.stop())
