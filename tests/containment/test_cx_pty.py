"""Attacks through interactive terminals (PTY execs, issue 24 item 5).

A PTY child is an exec like any other: its own Landlock domain (ptrace scope: no /proc/PID/fd
of the agent, which holds every terminal's master, or of another exec), the sandbox user, the
command limits. Its terminal's slave is the agent's (root, 0620), so another exec of the
sandbox user cannot open it to read what is typed there or to write into it. A terminal that
floods output to a follower that reads nothing is paced: the program waits in write(), the
apiserver holds a bounded window, not the flood.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

from containment._util import DENIED, PRELUDE, EPILOGUE

MB = 1 << 20


async def _until(pty, pattern: bytes, timeout: float = 30.0) -> re.Match:
    buf = bytearray()

    async def read() -> re.Match:
        async for chunk in pty.output():
            buf.extend(chunk)
            m = re.search(pattern, bytes(buf))
            if m:
                return m
        raise AssertionError(f"the terminal ended before {pattern!r}: {bytes(buf)[-2000:]!r}")
    return await asyncio.wait_for(read(), timeout)


async def test_pty_child_cannot_reach_other_terminals_or_the_agent(attacker):
    """The attacker's terminal program (uid 1000) tries the victim terminal's slave (read: steal
    keystrokes; write: inject output), the agent's fds (its masters), the victim shell's fds,
    and a Landlock-denied write; all refused. The victim still works afterwards."""
    victim = await attacker.pty("echo pid=$$; tty; cat", cols=80, rows=24)
    m = await _until(victim, rb"pid=(\d+)\r\n(/dev/pts/\d+)\r\n")
    vpid, vtty = int(m.group(1)), m.group(2).decode()
    await attacker.files.write("/tmp/pty-attack.py", PRELUDE + f"""
import fcntl, termios
OUT["uid"] = os.getuid()
OUT["own_tty"] = os.ttyname(0)
for mode, name in ((os.O_RDONLY, "read"), (os.O_WRONLY, "write")):
    try:
        os.close(os.open({vtty!r}, mode | os.O_NOCTTY))
        OUT["victim_" + name] = "ok"
    except OSError as e:
        OUT["victim_" + name] = errno.errorcode[e.errno]
for what, path in (("agent_fds", "/proc/1/fd"), ("victim_fds", "/proc/{vpid}/fd")):
    try:
        OUT[what] = "ok:" + ",".join(os.readlink(path + "/" + f) for f in os.listdir(path))
    except OSError as e:
        OUT[what] = errno.errorcode[e.errno]
try:
    open("/proc/self/oom_score_adj", "w").write("-1000")
    OUT["landlock"] = "ok"
except OSError as e:
    OUT["landlock"] = errno.errorcode[e.errno]
""" + EPILOGUE.replace("print(", "print('RESULT' + "), mode=0o644)
    att = await attacker.pty("python3 /tmp/pty-attack.py", cols=200, rows=24)
    out = json.loads((await _until(att, rb"RESULT(\{.*\})")).group(1))
    assert out["uid"] == 1000 and out["own_tty"] != vtty, out
    assert out["victim_read"] in DENIED and out["victim_write"] in DENIED, out
    assert out["agent_fds"] in DENIED and out["victim_fds"] in DENIED, out
    assert out["landlock"] in DENIED + ("EROFS",), out      # /proc is a read-only mount (D11)
    await victim.send(b"still here\n")
    await _until(victim, rb"still here\r\nstill here\r\n")     # echo, then cat's copy
    await victim.kill()
    assert (await victim.wait()).signal == 9


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_pty_flood_to_a_reader_that_stops_is_paced(server, cx):
    """A terminal floods (64 KiB blocks, counted in /tmp/n) while its follower reads nothing:
    the count stops (the program blocks on the terminal) well below what 20 s of flooding
    makes, and the apiserver does not grow by the flood."""
    sb = await cx.create_container(image="busybox", cpu_cores=1, memory_mb=256)
    try:
        pid = server.proc.pid
        rss0 = _rss_mib(pid)
        pty = await sb.pty("i=0; while :; do head -c 65536 /dev/zero | tr '\\0' x; i=$((i+1)); echo $i > /tmp/n; done")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.port))
        s.sendall(f"GET /v1/sandboxes/{sb.id}/execs/{pty.exec_id}/stream HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {server.key}\r\n\r\n".encode())
        try:
            peak = rss0
            t_end = time.monotonic() + 15
            while time.monotonic() < t_end:
                peak = max(peak, _rss_mib(pid))
                await asyncio.sleep(0.5)
            n1 = int((await sb.run("cat /tmp/n")).stdout)
            await asyncio.sleep(3)
            n2 = int((await sb.run("cat /tmp/n")).stdout)
            assert n1 == n2, f"the terminal's program kept writing ({n1} -> {n2} blocks): not paced"
            assert n1 * 64 * 1024 < 48 * MB, f"{n1} blocks of 64 KiB went out to a reader that reads nothing"
            assert peak - rss0 <= 50, (rss0, peak)
        finally:
            s.close()
        await pty.kill()
        assert (await pty.wait()).signal == 9
    finally:
        await sb.stop()
