"""Attacks on the in-sandbox agent (PID 1) and on other sessions of the same sandbox.

The agent's channel to the edge is fd 3 (listening) and an accepted connection, both
close-on-exec; the socket's path exists only on the host. Every command and session runs in its
own Landlock domain, whose ptrace scope keeps it away from the agent, the supervisors and
other commands (/proc/PID/{fd,mem,environ}, ptrace, pidfd_getfd).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from containment._util import py, sh


def _agent_state(server, sandbox_id: str) -> str:
    pid = int((server.paths.sandboxes / sandbox_id / "run" / "pid").read_text())
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return "?"


async def test_forge_agent_requests_socket_unreachable(attacker, server):
    """Finding the agent's socket to forge requests fails: no socket in the filesystem or /proc/net/unix, its host path does not exist inside, commands hold no inherited fds, and pidfd_getfd / /proc/1/fd/3 on the agent are refused."""
    host_path = str(server.paths.sandboxes / attacker.id / "run" / "agent.sock")
    for user in ("root", None):
        out = await py(attacker, f"""
import stat
OUT["my_fds"] = sorted(int(x) for x in os.listdir("/proc/self/fd"))   # before opening anything
found = []
for root, dirs, files in os.walk("/"):
    if root in ("/proc", "/sys"):
        dirs[:] = []
        continue
    for f in files:
        try:
            if stat.S_ISSOCK(os.lstat(os.path.join(root, f)).st_mode):
                found.append(os.path.join(root, f))
        except OSError:
            pass
OUT["fs_sockets"] = found
OUT["proc_net_unix"] = read("/proc/net/unix")
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
OUT["connect_host_path"] = attempt(s.connect, {host_path!r})
pidfd = sc_ret(434, 1, 0)
OUT["pidfd_open"] = "ok" if isinstance(pidfd, int) else pidfd
OUT["getfd"] = sorted({{sc(438, pidfd, fd, 0) for fd in range(0, 16)}}) if isinstance(pidfd, int) else []
OUT["proc_fd3"] = attempt(os.open, "/proc/1/fd/3", os.O_RDWR)
OUT["proc_fd3_link"] = attempt(os.readlink, "/proc/1/fd/3")
""", user=user)
        assert out["fs_sockets"] == [], out
        assert "agent.sock" not in out["proc_net_unix"] and str(server.home) not in out["proc_net_unix"], out
        assert out["connect_host_path"] == "ENOENT", out
        assert out["my_fds"] == [0, 1, 2, 3], out     # stdio and the listing's own fd: nothing inherited
        assert out["getfd"] == ["EPERM"], out
        assert out["proc_fd3"] == "EACCES" and out["proc_fd3_link"] == "EACCES", out
    assert (await sh(attacker, "echo agent-ok")).stdout == "agent-ok\n"


async def test_ptrace_agent_and_other_processes(attacker, server):
    """ptrace (PTRACE_SEIZE), /proc/PID/mem, process_vm_readv and pidfd_getfd against the agent (PID 1) and every other process of the sandbox fail, for root and the user; the agent is never stopped."""
    bg = await attacker.run("sleep 60 >/dev/null 2>&1 & echo $!", session="bystander")
    try:
        for user in ("root", None):
            out = await py(attacker, """
me, parent = os.getpid(), os.getppid()
iov = ctypes.create_string_buffer(16)
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) in (me, parent):
        continue
    pid = int(p)
    r = {"seize": sc(101, 0x4206, pid, 0, 0)}                # PTRACE_SEIZE: permission check, no stop
    r["mem"] = attempt(os.open, f"/proc/{pid}/mem", os.O_RDWR)      # EROFS first: /proc is read-only
    r["mem_read"] = attempt(os.open, f"/proc/{pid}/mem", os.O_RDONLY)   # the ptrace check itself
    r["vm_readv"] = sc(310, pid, iov, 1, iov, 1, 0)
    pidfd = sc_ret(434, pid, 0)
    r["getfd"] = sc(438, pidfd, 0, 0) if isinstance(pidfd, int) else pidfd
    OUT[p] = r
""", user=user)
            assert "1" in out and len(out) >= 2, out       # the agent and at least the bystander's shell
            for pid, r in out.items():
                assert r["seize"] == "EPERM" and r["mem"] in ("EACCES", "EROFS"), (user, pid, r)
                assert r["mem_read"] == "EACCES", (user, pid, r)
                assert r["vm_readv"] == "EPERM" and r["getfd"] in ("EPERM", "ESRCH"), (user, pid, r)
        assert _agent_state(server, attacker.id) in ("S", "R"), "the agent was stopped"
        assert (await sh(attacker, "echo agent-ok")).stdout == "agent-ok\n"
    finally:
        await attacker.close_session("bystander")
        assert bg.exit_code == 0


async def test_other_sessions_output_and_stdin_not_reachable(attacker):
    """Another command (same user, or root) cannot read a running session's output or inject into its stdin through /proc/PID/fd/{0,1,2}: the victim's output arrives complete and nothing is injected."""
    victim_cmd = "for i in $(seq 1 30); do echo SECRET-$i; sleep 0.1; done"

    async def victim():
        return await attacker.run(victim_cmd, session="victim", timeout_s=60)

    task = asyncio.create_task(victim())
    await asyncio.sleep(0.8)                                 # the victim session is running
    results = []
    for user in (None, "root"):
        results.append(await py(attacker, """
me, parent = os.getpid(), os.getppid()
stolen, opened = [], []
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) in (me, parent):
        continue
    for fd in ("0", "1", "2"):
        path = f"/proc/{p}/fd/{fd}"
        try:
            rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            opened.append(path)
            time.sleep(0.2)
            try:
                stolen.append(os.read(rfd, 65536).decode(errors="replace"))
            except OSError:
                pass
        except OSError:
            pass
        try:
            wfd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            opened.append(path + ":w")
            os.write(wfd, b"echo INJECTED-$((6*7))\\n")
        except OSError:
            pass
OUT["opened"] = opened
OUT["stolen"] = stolen
""", user=user))
    r = await task
    for out in results:
        assert out["opened"] == [] and out["stolen"] == [], out
    assert r.stdout.splitlines() == [f"SECRET-{i}" for i in range(1, 31)], r
    assert "INJECTED" not in r.stdout + r.stderr
    after = await attacker.run("echo still-mine", session="victim")
    assert after.stdout == "still-mine\n"
    await attacker.close_session("victim")


async def test_agent_binary_and_proc_tampering(attacker, server):
    """Root inside cannot replace, remove or rename the agent binary (/.dsec/agent) nor write /proc/1/* knobs of the agent (oom_score_adj, comm, attr); the host's agent binary is unchanged (checked by the suite) and the agent still answers."""
    out = await py(attacker, """
OUT["write"] = attempt(os.open, "/.dsec/agent", os.O_WRONLY)
OUT["unlink"] = attempt(os.unlink, "/.dsec/agent")
OUT["rename_dir"] = attempt(os.rename, "/.dsec", "/dsec-moved")
OUT["replace"] = attempt(os.rename, "/usr/bin/true", "/.dsec/agent")
OUT["oom"] = attempt(lambda: open("/proc/1/oom_score_adj", "w").write("1000"))
OUT["attr"] = attempt(lambda: open("/proc/1/attr/current", "w").write("x"))
OUT["comm"] = attempt(lambda: open("/proc/1/comm", "w").write("pwned"))
""")
    assert all(v in ("EROFS", "EACCES", "EPERM", "EBUSY", "ETXTBSY", "EXDEV", "EINVAL", "ENOENT")
               for v in out.values()), out
    assert out["write"] != "ok" and out["oom"] != "ok", out
    assert _agent_state(server, attacker.id) in ("S", "R")
    assert (await sh(attacker, "echo agent-ok")).stdout == "agent-ok\n"


async def test_root_cannot_change_the_agents_resource_limits(cx):
    """Issue 22, item 6: `prlimit --pid 1 --as=...` as root left the sandbox "running" while
    every exec answered "bad CMD", and `--nofile` ended the agent (that request a 500). New
    limits for PID 1 are refused (seccomp); reading them and a command's own limits still work."""
    sb = await cx.create_container(image="debian-python")
    try:
        r = await sb.run("prlimit --pid 1 --as=10000000; echo rc=$?; prlimit --pid 1 --nofile=3:3; echo rc=$?; "
                         "prlimit --pid 1 --nofile --noheadings | wc -l; "
                         "prlimit --nofile=64:64 sh -c 'ulimit -n'", user="root")
        lines = r.stdout.split()
        assert lines[:2] == ["rc=1", "rc=1"], r
        assert "Operation not permitted" in r.stderr, r
        assert lines[2] == "1" and lines[3] == "64", r          # reading, and one's own limits
        for _ in range(3):                                      # the agent still serves
            assert (await sb.run("echo served")).stdout == "served\n"
        assert (await sb.refresh()).state.value == "running"
    finally:
        await sb.stop()
