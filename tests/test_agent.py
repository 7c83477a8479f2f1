"""End-to-end tests of the in-sandbox agent: the real static binary runs on the host as a
subprocess (not PID 1, so it makes itself a child subreaper) with a listening unix socket
passed via -f, driven through the real asyncio client. Tests run as root."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from dsec import procstat
from dsec.agent import protocol as P
from dsec.agent.build import agent_binary
from dsec.agent.client import AgentClient, AgentDisconnected, AgentError, Exit, Output

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="agent tests switch uids: run as root")

USER = 1000  # unprivileged sandbox user (needs no passwd entry)


@pytest.fixture(scope="session")
def agent_bin(tmp_path_factory) -> Path:
    return agent_binary(tmp_path_factory.mktemp("agent-bin"))


class Agent:
    def __init__(self, binary: Path, shell: str | None = None, extra: tuple[str, ...] = ()):
        # not pytest's tmp_path: its parents are 0700, uid 1000 could not reach the workdir
        self.root = Path(tempfile.mkdtemp(prefix="dsec-agent-", dir="/tmp"))
        self.root.chmod(0o755)
        self.workdir = self.root / "work"
        self.sock = str(self.root / "agent.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.sock)
        listener.listen(16)
        fd = listener.fileno()
        args = [str(binary), "-f", str(fd), "-w", str(self.workdir), "-u", str(USER), "-g", str(USER)]
        if shell:
            args += ["-s", shell]
        args += list(extra)
        self.proc = subprocess.Popen(args, pass_fds=[fd])
        listener.close()
        self.clients: list[AgentClient] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def client(self) -> AgentClient:
        c = await AgentClient.connect(self.sock)
        self.clients.append(c)
        return c

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    async def stop(self) -> None:
        for c in self.clients:
            await c.close()
        if self.proc.poll() is None:
            self.proc.terminate()  # supervisors get SIGTERM via PDEATHSIG and kill their trees
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.returncode in (0, -signal.SIGTERM), f"agent died: {self.proc.returncode}"
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
async def agent(agent_bin):
    a = Agent(agent_bin)
    yield a
    await a.stop()


@pytest.fixture
async def client(agent) -> AgentClient:
    return await agent.client()


async def run(c: AgentClient, chan: int, cmd: str, *, uid: int = 0, gid: int = 0, **kw):
    """-> (stdout, stderr, Exit)"""
    out, err, ex = bytearray(), bytearray(), None
    async for item in c.exec(chan, cmd=cmd, uid=uid, gid=gid, **kw):
        if isinstance(item, Output):
            (out if item.stream == "stdout" else err).extend(item.data)
        else:
            assert isinstance(item, Exit)
            ex = item
    assert ex is not None
    return bytes(out), bytes(err), ex


def pid_alive(pid: int) -> bool:
    try:
        state = procstat.fields(pid)[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# ---------------------------------------------------------------------------- exec basics


async def test_exit_codes_and_streams(client):
    out, err, ex = await run(client, 1, "echo out; echo err >&2; exit 7")
    assert (out, err) == (b"out\n", b"err\n")
    assert ex.exit_code == 7 and ex.signal is None and not ex.timed_out and not ex.truncated
    assert (ex.stdout_total, ex.stderr_total) == (4, 4)
    _, _, ex = await run(client, 2, "true")
    assert ex.exit_code == 0
    _, _, ex = await run(client, 3, "kill -TERM $$")
    assert ex.exit_code is None and ex.signal == signal.SIGTERM


async def test_binary_output_and_stdin(client):
    out, _, ex = await run(client, 1, "printf '\\000\\377\\001abc'")
    assert out == b"\x00\xff\x01abc" and ex.exit_code == 0
    blob = bytes(range(256)) * 4096  # 1 MiB, beyond any pipe buffer
    out, _, ex = await run(client, 2, "sha256sum", stdin=blob)
    import hashlib

    assert out.split()[0].decode() == hashlib.sha256(blob).hexdigest()
    out, _, _ = await run(client, 3, "cat")  # no STDIN: /dev/null, returns at once
    assert out == b""


async def test_keep_stdin(client):
    got = bytearray()

    async def consume():
        async for item in client.exec(1, cmd="while read l; do echo got:$l; done; echo end", uid=0, gid=0,
                                      keep_stdin=True, stdin=b"a\n"):
            if isinstance(item, Output):
                got.extend(item.data)
            else:
                return item

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    await client.send_stdin(1, b"b\n")
    await client.send_stdin(1, b"")
    ex = await asyncio.wait_for(task, 5)
    assert got == b"got:a\ngot:b\nend\n" and ex.exit_code == 0


async def test_env_and_cwd(client, agent):
    out, _, _ = await run(client, 1, "echo $FOO $HOME $LANG $USER; pwd", env={"FOO": "bar", "LANG": "C"})
    assert out == f"bar /root C root\n{agent.workdir}\n".encode()
    out, _, _ = await run(client, 2, "pwd; echo $HOME $USER", cwd="/tmp", uid=USER, gid=USER)
    assert out == f"/tmp\n{agent.workdir} sandbox\n".encode()
    with pytest.raises(AgentError) as ei:
        await run(client, 3, "true", cwd="/nonexistent/dir")
    assert ei.value.errno == errno.ENOENT and "chdir" in ei.value.message


async def test_uid_switch_and_file_ownership(client, agent):
    out, _, _ = await run(client, 1, "id -u; id -g; id -G", uid=USER, gid=USER)
    assert out == b"1000\n1000\n1000\n"
    await client.write_file("owned.txt", b"hello", uid=USER, gid=USER)
    st = (agent.workdir / "owned.txt").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (USER, USER, 0o644)
    secret = agent.root / "secret"
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    with pytest.raises(AgentError) as ei:
        await client.read_file(str(secret), uid=USER, gid=USER)
    assert ei.value.errno == errno.EACCES
    assert await client.read_file(str(secret), uid=0, gid=0) == b"root only"
    _, _, ex = await run(client, 2, f"cat {secret}", uid=USER, gid=USER)
    assert ex.exit_code == 1


# ---------------------------------------------------------------------------- timeouts and caps


async def test_timeout_kills_whole_tree(client, agent):
    pidfile = agent.root / "grandchild.pid"
    cmd = f"setsid sh -c 'echo $$ > {pidfile}; exec sleep 60' & sleep 60"
    t0 = time.monotonic()
    out, _, ex = await run(client, 1, cmd, timeout_ms=500)
    assert time.monotonic() - t0 < 3
    assert ex.timed_out and ex.signal == signal.SIGKILL and ex.exit_code is None
    gpid = int(pidfile.read_text())
    for _ in range(50):
        if not pid_alive(gpid):
            break
        await asyncio.sleep(0.05)
    assert not pid_alive(gpid), "setsid grandchild survived the timeout"


async def test_output_cap_pipeline(client, agent):
    out, _, ex = await run(client, 1, "yes | head -c 50000000", cap=1 << 20)
    assert ex.exit_code == 0 and ex.truncated and ex.stdout_total == 50_000_000
    assert len(out) == 1 << 20 and out[:4] == b"y\ny\n"
    assert agent.rss_kib() < 16 * 1024


async def test_output_cap_with_timeout(client, agent):
    out, err, ex = await run(client, 1, "yes; echo never", timeout_ms=700, cap=4096)
    assert ex.timed_out and ex.truncated and len(out) == 4096
    assert ex.stdout_total > 10 * 4096  # kept reading (and dropping) until the kill
    assert agent.rss_kib() < 8 * 1024


async def test_streaming_is_live(client):
    t0 = time.monotonic()
    first_at = None
    async for item in client.exec(1, cmd="echo first; sleep 1; echo second", uid=0, gid=0):
        if isinstance(item, Output) and first_at is None:
            first_at = time.monotonic() - t0
            assert item.data == b"first\n"
    assert first_at is not None and first_at < 0.5
    assert time.monotonic() - t0 >= 1


async def test_background_holding_pipe(client, agent):
    t0 = time.monotonic()
    out, _, ex = await run(client, 1, f"sleep 30 & echo $! > {agent.root}/bg.pid; echo started")
    assert time.monotonic() - t0 < 1.0
    assert out == b"started\n" and ex.exit_code == 0
    bg = int((agent.root / "bg.pid").read_text())
    assert pid_alive(bg)  # background jobs keep running, as in a shell
    os.kill(bg, signal.SIGKILL)


async def test_signal(client):
    async def later():
        await asyncio.sleep(0.3)
        await client.signal(1, signal.SIGINT)

    task = asyncio.create_task(later())
    t0 = time.monotonic()
    _, _, ex = await run(client, 1, "sleep 30")
    await task
    assert time.monotonic() - t0 < 5 and ex.signal == signal.SIGINT


# ---------------------------------------------------------------------------- sessions


async def test_session_state_and_errors(client, agent):
    _, _, ex = await run(client, 1, "cd /tmp && export ANSWER=42 && f() { echo fn; }", session="s1")
    assert ex.exit_code == 0 and not ex.session_ended
    out, _, ex = await run(client, 2, "pwd; echo $ANSWER; f; false", session="s1")
    assert out == b"/tmp\n42\nfn\n" and ex.exit_code == 1
    out, err, ex = await run(client, 3, "if then fi (", session="s1")
    assert ex.exit_code == 2 and b"syntax error" in err and out == b"" and not ex.session_ended
    # nothing in CMD can swallow the end markers or disturb the next command
    out, err, ex = await run(client, 4, "echo 'it''s'; cat <<EOF\nheredoc\nEOF", session="s1")
    assert out == b"its\nheredoc\n" and ex.exit_code == 0
    for i, cmd in enumerate(["echo a \\", "echo b \\\n", "cat <<'EOF'\nunterminated", "echo \"q'uote\""]):
        out, _, ex = await run(client, 40 + i, cmd, session="s1")
        assert ex.exit_code == 0 and not ex.session_ended, (cmd, ex)
        out, _, ex = await run(client, 50 + i, "echo next", session="s1")
        assert out == b"next\n" and ex.exit_code == 0, cmd
    out, _, ex = await run(client, 5, "echo $ANSWER; echo partial-line-no-newline", session="s1")
    assert out == b"42\npartial-line-no-newline\n"
    out, _, ex = await run(client, 6, "printf 'no newline'; printf 'err' >&2", session="s1")
    assert out == b"no newline" and ex.exit_code == 0 and ex.stderr_total == 3
    out, _, ex = await run(client, 7, "echo bye; exit 3", session="s1")
    assert out == b"bye\n" and ex.exit_code == 3 and ex.session_ended
    out, _, ex = await run(client, 8, "pwd; echo ${ANSWER:-unset}", session="s1")
    assert out == f"{agent.workdir}\nunset\n".encode() and not ex.session_ended


async def test_session_with_dash(agent_bin):
    # dash exits on a syntax error even inside eval: the syntax check keeps the session alive
    a = Agent(agent_bin, shell="/bin/sh")
    try:
        c = await a.client()
        await run(c, 1, "X=1; cd /", session="d")
        _, err, ex = await run(c, 2, "if then", session="d")
        assert ex.exit_code == 2 and err and not ex.session_ended
        out, _, ex = await run(c, 3, "echo $X; pwd", session="d")
        assert out == b"1\n/\n" and not ex.session_ended
        for i, cmd in enumerate(["echo a \\", "cat <<'EOF'\nunterminated", "exit 5"]):
            _, _, ex = await run(c, 10 + i, cmd, session="d")
        assert ex.exit_code == 5 and ex.session_ended
    finally:
        await a.stop()


async def test_session_busy_timeout_and_close(client):
    it = client.exec(1, cmd="sleep 2", uid=0, gid=0, session="s2")
    task = asyncio.create_task(it.__anext__())
    await asyncio.sleep(0.3)
    with pytest.raises(AgentError) as ei:
        await run(client, 2, "true", session="s2")
    assert ei.value.errno == errno.EBUSY
    await client.signal(1, signal.SIGKILL)  # signals go to the session shell's group
    ex = await asyncio.wait_for(task, 5)
    assert isinstance(ex, Exit) and ex.session_ended
    await run(client, 3, "export K=v", session="s2")
    _, _, ex = await run(client, 4, "sleep 30", session="s2", timeout_ms=300)
    assert ex.timed_out and ex.session_ended
    out, _, ex = await run(client, 5, "echo ${K:-fresh}", session="s2")
    assert out == b"fresh\n"
    await client.close_session("s2")
    await client.close_session("never-existed")
    out, _, _ = await run(client, 6, "echo ${K:-fresh2}", session="s2")
    assert out == b"fresh2\n"


async def test_session_runs_as_user(client, agent):
    out, _, _ = await run(client, 1, "id -u; pwd", session="u", uid=USER, gid=USER)
    assert out == f"1000\n{agent.workdir}\n".encode()


# ---------------------------------------------------------------------------- concurrency & reconnects


async def test_many_concurrent_execs(client):
    async def one(i):
        out, _, ex = await run(client, 100 + i, f"sleep 0.2; echo {i}")
        return out, ex.exit_code

    results = await asyncio.gather(*(one(i) for i in range(50)))
    assert results == [(f"{i}\n".encode(), 0) for i in range(50)]
    # file ops interleave with execs on the same connection
    await asyncio.gather(*(client.write_file(f"c{i}", b"x" * i, uid=USER, gid=USER) for i in range(20)))
    sizes = await asyncio.gather(*(client.read_file(f"c{i}", uid=USER, gid=USER) for i in range(20)))
    assert [len(s) for s in sizes] == list(range(20))


async def test_reconnect_and_attach(agent):
    c1 = await agent.client()
    it = c1.exec(5, cmd="echo early; sleep 1; echo done", uid=0, gid=0)
    assert await it.__anext__() == Output("stdout", b"early\n")
    await c1.close()
    c2 = await agent.client()
    assert (5, False) in await c2.list_execs()
    out = bytearray()
    async for item in c2.attach(5):
        if isinstance(item, Output):
            out += item.data
        else:
            ex = item
    assert out == b"early\ndone\n" and ex.exit_code == 0
    assert (5, True) in await c2.list_execs()
    # retained until RELEASE: attach again replays everything
    items = [i async for i in c2.attach(5)]
    assert items[0] == Output("stdout", b"early\ndone\n") and isinstance(items[-1], Exit)
    await c2.release(5)
    with pytest.raises(AgentError) as ei:
        [i async for i in c2.attach(5)]
    assert ei.value.errno == errno.ENOENT


async def test_large_output_live_and_replayed(agent):
    # paced producers (live output, ATTACH replay, file reads) must never stall, whatever
    # the socket takes per write; wait_for turns a stall into a failure instead of a hang
    c1 = await agent.client()
    out, _, ex = await asyncio.wait_for(run(c1, 1, "yes abcdefg | head -c 6000000", cap=8 << 20), 20)
    assert len(out) == 6_000_000 and not ex.truncated and ex.stdout_total == 6_000_000
    await c1.close()
    c2 = await agent.client()

    async def replay():
        got = bytearray()
        async for item in c2.attach(1):
            if isinstance(item, Output):
                got += item.data
        return bytes(got)

    for _ in range(3):
        assert await asyncio.wait_for(replay(), 20) == out
    await c2.write_file("f6", out, uid=USER, gid=USER)
    reads = [c2.read_file("f6", uid=USER, gid=USER) for _ in range(4)]
    assert await asyncio.wait_for(asyncio.gather(*reads), 30) == [out] * 4


async def test_second_connection_replaces_first(agent):
    c1 = await agent.client()
    it = c1.exec(1, cmd="sleep 5", uid=0, gid=0)
    pending = asyncio.create_task(it.__anext__())
    await asyncio.sleep(0.1)
    c2 = await agent.client()
    with pytest.raises(AgentDisconnected):
        await asyncio.wait_for(pending, 5)
    with pytest.raises(AgentDisconnected):
        await c1.ping()
    await c2.ping()
    await c2.signal(1, signal.SIGKILL)  # the exec itself survived the reconnect
    items = [i async for i in c2.attach(1)]
    assert items[-1].signal == signal.SIGKILL


async def test_disconnect_fails_pending_requests(agent):
    c = await agent.client()
    task = asyncio.create_task(run(c, 1, "sleep 5"))
    await asyncio.sleep(0.1)
    agent.proc.kill()
    with pytest.raises(AgentDisconnected):
        await asyncio.wait_for(task, 5)
    agent.proc.wait()
    agent.proc.returncode = 0  # killed on purpose


# ---------------------------------------------------------------------------- files


async def test_file_operations(client, agent):
    uid = gid = USER
    await client.mkdir("d1/d2", uid=uid, gid=gid, mode=0o750)
    assert (agent.workdir / "d1/d2").stat().st_mode & 0o777 == 0o750
    await client.mkdir("d1/d2", uid=uid, gid=gid)  # exists: fine, like mkdir -p
    await client.write_file("d1/d2/a.txt", b"abc", uid=uid, gid=gid, mode=0o600)
    await client.write_file("new/parents/b.bin", b"\x00\x01", uid=uid, gid=gid)
    assert (agent.workdir / "new/parents").stat().st_uid == USER
    with pytest.raises(AgentError) as ei:
        await client.write_file("nope/c.txt", b"", uid=uid, gid=gid, mkdirs=False)
    assert ei.value.errno == errno.ENOENT
    await client.write_file("d1/d2/a.txt", b"replaced", uid=uid, gid=gid)
    assert await client.read_file("d1/d2/a.txt", uid=uid, gid=gid) == b"replaced"
    (agent.workdir / "d1/link").symlink_to("d2")
    entries = {e.name: e for e in await client.list_dir("d1", uid=uid, gid=gid)}
    assert entries["d2"].kind == "dir" and entries["link"].kind == "symlink"
    entries = await client.list_dir(str(agent.workdir / "d1/d2"), uid=uid, gid=gid)
    assert [(e.name, e.kind, e.size, e.mode) for e in entries] == [("a.txt", "file", 8, 0o644)]
    assert abs(entries[0].mtime - time.time()) < 60
    assert not [p for p in (agent.workdir / "d1/d2").iterdir() if p.name.startswith(".")]  # no temp files left

    for op in (
        client.read_file("missing", uid=uid, gid=gid),
        client.list_dir("missing", uid=uid, gid=gid),
        client.remove("missing", uid=uid, gid=gid),
    ):
        with pytest.raises(AgentError) as ei:
            await op
        assert ei.value.errno == errno.ENOENT
    with pytest.raises(AgentError) as ei:
        await client.read_file("d1", uid=uid, gid=gid)
    assert ei.value.errno == errno.EISDIR
    with pytest.raises(AgentError) as ei:
        await client.remove("d1", uid=uid, gid=gid)
    assert ei.value.errno == errno.ENOTEMPTY
    with pytest.raises(AgentError) as ei:
        await client.write_file("/etc/dsec-test", b"x", uid=uid, gid=gid)
    assert ei.value.errno == errno.EACCES
    await client.remove("d1/d2/a.txt", uid=uid, gid=gid)
    await client.remove("d1/link", uid=uid, gid=gid)
    await client.remove("d1/d2", uid=uid, gid=gid)
    assert [e.name for e in await client.list_dir("d1", uid=uid, gid=gid)] == []


async def test_big_file_and_maxlen(client, agent):
    blob = os.urandom(20 << 20)
    await asyncio.wait_for(client.write_file("big.bin", blob, uid=USER, gid=USER), 20)
    assert await asyncio.wait_for(client.read_file("big.bin", uid=USER, gid=USER), 20) == blob
    with pytest.raises(AgentError) as ei:
        await client.read_file("big.bin", uid=USER, gid=USER, maxlen=1 << 20)
    assert ei.value.errno == errno.EFBIG
    assert await client.read_file("big.bin", uid=USER, gid=USER, maxlen=20 << 20) == blob
    await client.remove("big.bin", uid=USER, gid=USER)
    await asyncio.sleep(0.1)
    assert agent.rss_kib() < 4 * 1024  # big buffers were given back


# ---------------------------------------------------------------------------- robustness


async def raw_roundtrip(agent, data: bytes) -> bytes:
    """Send raw bytes on a fresh connection, return whatever comes back before EOF/timeout."""
    reader, writer = await asyncio.open_unix_connection(agent.sock)
    writer.write(data)
    await writer.drain()
    got = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 1):
            got += chunk
    except asyncio.TimeoutError:
        pass
    writer.close()
    return got


def frames(buf: bytes) -> list[tuple[int, int, bytes]]:
    out = []
    while len(buf) >= P.HEADER_SIZE:
        n, t, _, _, chan = P.HEADER.unpack_from(buf)
        out.append((t, chan, buf[P.HEADER_SIZE : P.HEADER_SIZE + n]))
        buf = buf[P.HEADER_SIZE + n :]
    return out


async def test_malformed_frames(agent):
    # unknown type and broken fields: ERROR, connection stays usable
    bad_fields = P.encode_frame(P.MsgType.EXEC, 9, b"\x01\xff\xff\xff\x7f")
    got = frames(
        await raw_roundtrip(
            agent,
            P.encode_frame(77, 3, b"junk") + bad_fields
            + P.encode_frame(P.MsgType.EXEC, 0, P.encode_fields([(P.Tag.CMD, "true")]))
            + P.encode_frame(P.MsgType.EXEC, 8, P.encode_fields([(P.Tag.CMD, "a\0b")]))
            + P.encode_frame(P.MsgType.SIGNAL, 4242, b"")
            + P.encode_frame(P.MsgType.PING, 5),
        )
    )
    assert [(t, c) for t, c, _ in got] == [
        (P.MsgType.ERROR, 3), (P.MsgType.ERROR, 9), (P.MsgType.ERROR, 0), (P.MsgType.ERROR, 8),
        (P.MsgType.ERROR, 4242), (P.MsgType.PONG, 5),
    ]
    assert all(P.decode_error(p)[0] == errno.EINVAL for t, _, p in got[:4])
    # oversize length: ERROR then the agent hangs up
    got = frames(await raw_roundtrip(agent, struct.pack("<IBBHI", 0xFFFFFFF0, 1, 0, 0, 1) + b"x" * 100))
    assert got and got[0][0] == P.MsgType.ERROR and P.decode_error(got[0][2])[0] == errno.EMSGSIZE
    # pure garbage, then a truncated frame and a hang-up mid-frame
    await raw_roundtrip(agent, os.urandom(4096))
    await raw_roundtrip(agent, struct.pack("<IBBHI", 1000, 1, 0, 0, 1) + b"abc")
    assert agent.proc.poll() is None
    c = await agent.client()
    out, _, _ = await run(c, 1, "echo alive")
    assert out == b"alive\n"


async def test_idle_rss(agent):
    c = await agent.client()
    for i in range(5):
        await run(c, i + 1, "echo warm")
        await c.release(i + 1)
    await c.ping()
    await asyncio.sleep(0.2)
    rss = agent.rss_kib()
    print(f"idle agent VmRSS: {rss} kB")
    assert rss < 1024


# ---------------------------------------------------------------------------- containment: Landlock, limits


def landlock_abi() -> int:
    import ctypes

    v = ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1)   # LANDLOCK_CREATE_RULESET_VERSION
    return v if v > 0 else 0


needs_landlock = pytest.mark.skipif(landlock_abi() < 2, reason="kernel without Landlock ABI >= 2")


async def _sibling_probe(c: AgentClient, uid: int, chan: int) -> bytes:
    """A uid-`uid` session holds a secret in its environment; a plain exec of the same uid
    tries to read it, to steal the session's input (its stdin pipe, re-opened for reading
    through /proc) and to forge its output (its stdout pipe, re-opened for writing), and reads
    the environment of its own child. -> the probe's stdout."""
    out, _, _ = await run(c, chan, "echo $$", session=f"victim{uid}", uid=uid, gid=uid, env={"SECRET": "s3cr3t"})
    pid = int(out.split()[-1])
    probe = (f"tr '\\0' '\\n' < /proc/{pid}/environ | grep SECRET; "
             f"timeout 1 cat /proc/{pid}/fd/0; echo stdin-open-rc=$?; "
             f"echo forged > /proc/{pid}/fd/1 && echo forged-ok; "
             f"sleep 5 & sleep 0.2; tr '\\0' '\\n' < /proc/$!/environ | grep -c ^PATH=; kill $!")
    out, _, _ = await run(c, chan + 1, probe, uid=uid, gid=uid)
    return out


@needs_landlock
async def test_landlock_separates_execs_and_sessions(agent_bin):
    """The point of a domain per exec/session: a sibling's environment and pipes are out of
    reach, a command's own children stay reachable. Control: the same probes against an
    agent with Landlock off get through (environ for the same uid; the pipes, which the agent
    creates as root, for root: sandbox root has CAP_DAC_OVERRIDE)."""
    a = Agent(agent_bin)
    try:
        c = await a.client()
        assert await c.landlock_abi() == landlock_abi()
        assert await _sibling_probe(c, USER, 1) == b"stdin-open-rc=1\n1\n"
        # (on this host root keeps CAP_PERFMON, which lets mm_access() read environ whatever
        # Landlock says; sandboxes never have it: see test_hardening.py)
        assert (await _sibling_probe(c, 0, 3)).endswith(b"stdin-open-rc=1\n1\n")
        out, _, _ = await run(c, 5, "echo $SECRET", session=f"victim{USER}", uid=USER, gid=USER)
        assert out == b"s3cr3t\n"
        # the agent itself: not dumpable, outside every domain
        _, err, ex = await run(c, 6, f"cat /proc/{a.pid}/environ; ls /proc/{a.pid}/fd", uid=USER, gid=USER)
        assert ex.exit_code != 0 and err.count(b"Permission denied") == 2
        _, err, ex = await run(c, 7, f"timeout 1 cat /proc/{a.pid}/fd/0")
        assert ex.exit_code == 1 and b"Permission denied" in err
    finally:
        await a.stop()
    a = Agent(agent_bin, extra=("-L", "0"))
    try:
        c = await a.client()
        assert await c.landlock_abi() == 0
        assert (await _sibling_probe(c, USER, 1)).startswith(b"SECRET=s3cr3t\n")
        assert (await _sibling_probe(c, 0, 3)).endswith(b"stdin-open-rc=124\nforged-ok\n1\n")
    finally:
        await a.stop()


async def test_landlock_filesystem_rules(client, agent):
    """Root commands (on this host: with every capability) still cannot write /proc, /sys,
    /dev or create top-level entries, nor make device nodes or run code from /dev/shm."""
    denied = ["echo x > /proc/self/comm", "touch /dev/dsec-test-x", "mknod /tmp/dsec-test-c c 1 3",
              "mkdir /dsec-test-newtop", "cp /bin/true /dev/shm/dsec-t && /dev/shm/dsec-t",
              "echo 1 > /sys/kernel/mm/ksm/run"]
    for i, cmd in enumerate(denied):
        _, err, ex = await run(client, 10 + i, cmd)
        assert ex.exit_code != 0 and (b"Permission denied" in err or b"Read-only" in err), (cmd, err)
    assert not Path("/dev/dsec-test-x").exists() and not Path("/dsec-test-newtop").exists()
    ok = (f"echo > /dev/null && echo x > /dev/shm/dsec-f && rm /dev/shm/dsec-f && mkfifo {agent.workdir}/fifo "
          f"&& echo y > /tmp/dsec-f-$$ && mv /tmp/dsec-f-$$ {agent.workdir}/moved && cat {agent.workdir}/moved "
          "&& python3 -c 'import pty; pty.openpty()' && echo fine")
    out, err, ex = await run(client, 30, ok, uid=USER, gid=USER)
    assert (out, ex.exit_code) == (b"y\nfine\n", 0), err


async def test_command_limits(agent_bin):
    a = Agent(agent_bin, extra=("-n", "200", "-F", str(1 << 20)))
    try:
        c = await a.client()
        out, _, _ = await run(c, 1, "ulimit -Sn; ulimit -Hn; ulimit -c; ulimit -f", uid=USER, gid=USER)
        assert out.split() == [b"200", b"200", b"0", b"1024"]
        _, _, ex = await run(c, 2, "ulimit -n 1000")   # hard limit: not even root raises it
        assert ex.exit_code != 0
        out, _, _ = await run(c, 3, "head -c 3M /dev/zero > big; stat -c %s big", uid=USER, gid=USER)
        assert out == b"1048576\n"
    finally:
        await a.stop()
    a = Agent(agent_bin)   # defaults: 4096 open files, no file size limit, no core dumps
    try:
        out, _, _ = await run(await a.client(), 1, "ulimit -Sn; ulimit -Hn; ulimit -c; ulimit -f")
        assert out.split() == [b"4096", b"4096", b"0", b"unlimited"]
    finally:
        await a.stop()


async def test_file_api_refuses_magic_links(client, agent):
    """The agent is unconfined (and PID 1 in a sandbox): its own /proc/self/fd/* are host files
    (stderr: the sandbox's init.log). The file API does not traverse /proc magic links."""
    for path in ("/proc/self/fd/2", f"/proc/{agent.pid}/fd/1", "/proc/self/cwd/etc/hostname"):
        with pytest.raises(AgentError) as ei:
            await client.read_file(path, uid=0, gid=0)
        assert ei.value.errno == errno.ELOOP, path
    with pytest.raises(AgentError) as ei:
        await client.list_dir("/proc/self/root/", uid=0, gid=0)
    assert ei.value.errno == errno.ELOOP
    assert b"Uid:" in await client.read_file("/proc/self/status", uid=0, gid=0)   # plain /proc files are fine


async def test_refresh_is_refused_outside_device_mode(client):
    """REFRESH sets the clock and reseeds the kernel RNG: only a VM guest's agent (device mode)
    does it; a container's agent shares the host kernel and must refuse, changing nothing."""
    before = time.time()
    with pytest.raises(AgentError) as e:
        await client.refresh(seed=os.urandom(64), time_ns=0)
    assert e.value.errno == errno.EPERM and "device mode" in str(e.value)
    assert time.time() >= before      # the host clock was not set to 1970
