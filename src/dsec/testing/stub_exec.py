"""Commands of the agent stub (`agent_stub.AgentStub`): plain execs, session shells, their
retained output and the connection it goes to.

Semantics follow docs/agent-protocol.md ("Exec semantics") as far as an unprivileged host
process can: commands are `SHELL -c CMD` in a new process group (SIGNAL and timeouts hit the
group), output is capped per stream and retained for ATTACH, an exec ends when the command has
exited and both pipes are at EOF (or 100 ms after it exited, if background children hold them).
Sessions are one persistent shell per name driven with the agent's own end markers.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from dsec.agent import protocol as P
from dsec.agent.protocol import MsgType

OUTPUT_FRAME = 256 << 10        # STDOUT/STDERR frames are at most this big
PIPE_GRACE_S = 0.1              # after the command exited, background children may hold the pipes
_STREAMS = (MsgType.STDOUT, MsgType.STDERR)


class Conn:
    """One accepted connection; a newer one replaces it (the edge restarted)."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.live = True

    def send(self, type_: int, chan: int, payload: bytes = b"") -> None:
        # write() without drain: frames keep their order and the stub never blocks on a
        # slow reader (tests move little data; the real agent bounds its queue instead)
        if self.live and not self.writer.is_closing():
            self.writer.write(P.encode_frame(type_, chan, payload))

    def close(self) -> None:
        self.live = False
        self.writer.close()


def kill_group(pid: int | None, sig: int = signal.SIGKILL) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Exec:
    """One exec chan: what it retained, where its output goes, how it ended."""

    def __init__(self, chan: int, cap: int, conn: Conn, on_done: Callable[[Exec], None]):
        self.chan = chan
        self.cap = cap
        self.conn: Conn | None = conn     # the EXEC's sender or the latest ATTACH
        self.out = (bytearray(), bytearray())
        self.totals = [0, 0]
        self.exit: P.ExitInfo | None = None
        self.pgid: int | None = None      # target of SIGNAL while it runs
        self.group: int | None = None     # its process group, also after it finished
        self.stdin: asyncio.StreamWriter | None = None   # KEEP_STDIN
        self.release_when_done = False
        self.task: asyncio.Task[None] | None = None
        self._on_done = on_done

    @property
    def finished(self) -> bool:
        return self.exit is not None

    def _send(self, type_: int, payload: bytes = b"") -> None:
        if self.conn is not None:
            self.conn.send(type_, self.chan, payload)

    def emit(self, stream: int, data: bytes) -> None:
        """Output of the command: counted in full, retained and forwarded up to the cap."""
        self.totals[stream] += len(data)
        kept = data[: max(0, self.cap - len(self.out[stream]))]
        if not kept:
            return
        self.out[stream].extend(kept)
        for i in range(0, len(kept), OUTPUT_FRAME):
            self._send(_STREAMS[stream], kept[i : i + OUTPUT_FRAME])

    def attach(self, conn: Conn) -> None:
        """Replay retained stdout, then stderr, then EXIT if finished; follow it from now on."""
        self.conn = conn
        for stream, buf in enumerate(self.out):
            for i in range(0, len(buf), OUTPUT_FRAME):
                self._send(_STREAMS[stream], bytes(buf[i : i + OUTPUT_FRAME]))
        if self.exit is not None:
            self._send(MsgType.EXIT, P.encode_exit(self.exit))

    def finish(self, *, returncode: int | None = None, exit_code: int = 0, sig: int = 0,
               timed_out: bool = False, session_ended: bool = False) -> None:
        """returncode: asyncio's (negative = killed by that signal); else exit_code/sig."""
        if self.exit is not None:
            return
        if returncode is not None:
            exit_code, sig = (-1, -returncode) if returncode < 0 else (returncode, 0)
        truncated = any(t > self.cap for t in self.totals)
        self.exit = P.ExitInfo(exit_code, sig, timed_out, truncated, session_ended, *self.totals)
        self.pgid = None
        self._send(MsgType.EXIT, P.encode_exit(self.exit))
        self._on_done(self)

    def signal(self, sig: int) -> None:
        if self.exit is None:
            kill_group(self.pgid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)


async def _pump(stream: asyncio.StreamReader, sink: Callable[[bytes], None]) -> None:
    while chunk := await stream.read(64 << 10):
        sink(chunk)


async def spawn(shell: str, args: list[str], *, cwd: Path, env: dict[str, str],
                stdin: bool) -> asyncio.subprocess.Process:
    """Start a command in its own process group (raises OSError: missing cwd, shell ...)."""
    return await asyncio.create_subprocess_exec(
        shell, *args, cwd=cwd, env=env, start_new_session=True,
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


def begin_plain(e: Exec, proc: asyncio.subprocess.Process, stdin: bytes | None, keep_stdin: bool) -> None:
    """Wire a spawned command to its exec before the next frame is read (a STDIN or SIGNAL
    frame may follow the EXEC at once)."""
    e.pgid = e.group = proc.pid
    if proc.stdin is not None:
        if stdin:
            proc.stdin.write(stdin)
        if keep_stdin:
            e.stdin = proc.stdin
        else:
            proc.stdin.close()


async def run_plain(e: Exec, proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    """Follow a started command to its end; the owner's task."""
    assert proc.stdout and proc.stderr
    pumps = [asyncio.create_task(_pump(proc.stdout, lambda d: e.emit(0, d))),
             asyncio.create_task(_pump(proc.stderr, lambda d: e.emit(1, d)))]
    timed_out = False
    try:
        async with asyncio.timeout(timeout_s or None):
            await proc.wait()
    except TimeoutError:
        timed_out = True
        kill_group(proc.pid)
        await proc.wait()
    finally:
        e.stdin = None
        _, late = await asyncio.wait(pumps, timeout=PIPE_GRACE_S)
        for t in late:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    if timed_out:
        e.finish(exit_code=-1, sig=signal.SIGKILL, timed_out=True)
    else:
        e.finish(returncode=proc.returncode)


class _Scan:
    """Finds a session command's end marker in one stream; holds back what may be its start."""

    def __init__(self, prefix: bytes):
        self.prefix = prefix
        self.pend = bytearray()
        self.done = False
        self.code = 0

    def feed(self, chunk: bytes) -> bytes:
        """-> the bytes that are the command's output for sure."""
        self.pend += chunk
        i = self.pend.find(self.prefix)
        if i >= 0:
            nl = self.pend.find(b"\n", i)
            out = bytes(self.pend[:i])
            if nl < 0:
                del self.pend[:i]
                return out
            digits = bytes(self.pend[i + len(self.prefix) : nl])
            self.code = int(digits) if digits.strip(b"-").isdigit() else 0
            self.done = True
            self.pend.clear()   # what follows the marker is background noise
            return out
        k = self.pend.rfind(b"\036")
        if k >= 0 and self.prefix.startswith(bytes(self.pend[k:])):
            out = bytes(self.pend[:k])
            del self.pend[:k]
            return out
        out = bytes(self.pend)
        self.pend.clear()
        return out


class Session:
    """A persistent shell per name: `cd` and `export` persist; one command at a time."""

    def __init__(self, name: str, shell: str, on_end: Callable[[Session], None],
                 own: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]):
        self.name = name
        self._own = own   # the stub owns (and waits for) every task
        self.shell = shell
        self.proc: asyncio.subprocess.Process | None = None
        self.cur: Exec | None = None
        self.closing = False
        self._on_end = on_end
        self._scan: list[_Scan] | None = None
        self._result: asyncio.Future[tuple[str, int]] | None = None
        self._ended = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self._ended.is_set()

    async def _start(self, cwd: Path, env: dict[str, str]) -> None:
        self.proc = await spawn(self.shell, [], cwd=cwd, env=env, stdin=True)
        self._watch = self._own(self._follow(self.proc))

    async def _follow(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout and proc.stderr
        pumps = [asyncio.create_task(_pump(proc.stdout, lambda d: self._feed(0, d))),
                 asyncio.create_task(_pump(proc.stderr, lambda d: self._feed(1, d)))]
        try:
            await proc.wait()
        finally:
            _, late = await asyncio.wait(pumps, timeout=PIPE_GRACE_S)
            for t in late:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._ended.set()
            if self._result is not None and not self._result.done():
                self._result.set_result(("ended", proc.returncode if proc.returncode is not None else -9))
            self._on_end(self)

    def _feed(self, stream: int, chunk: bytes) -> None:
        scan, e = self._scan, self.cur
        if scan is None or e is None or scan[stream].done:
            return   # output of background jobs between commands is dropped
        data = scan[stream].feed(chunk)
        if data:
            e.emit(stream, data)
        if all(s.done for s in scan) and self._result is not None and not self._result.done():
            self._result.set_result(("marker", scan[0].code))

    async def run(self, e: Exec, cmd: str, timeout_s: float, cwd: Path, env: dict[str, str]) -> None:
        """The owner's task for one EXEC on this session (e is already self.cur)."""
        try:
            code, err = await self._syntax_check(cmd, cwd, env)
            if code != 0:   # answered as a normal EXIT; the session survives
                e.emit(1, err)
                e.finish(exit_code=code)
                return
            if self.closing:
                e.finish(exit_code=-1, sig=signal.SIGKILL, session_ended=True)
                return
            if not self.alive:
                await self._start(cwd, env)
            await self._run_marked(e, cmd, timeout_s)
        finally:
            self.cur = None
            self._scan = self._result = None

    async def _syntax_check(self, cmd: str, cwd: Path, env: dict[str, str]) -> tuple[int, bytes]:
        proc = await asyncio.create_subprocess_exec(
            self.shell, "-n", cwd=cwd, env=env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate(cmd.encode())
        return proc.returncode or 0, err

    async def _run_marked(self, e: Exec, cmd: str, timeout_s: float) -> None:
        assert self.proc and self.proc.stdin
        nonce = secrets.token_hex(8)
        self._scan = [_Scan(f"\036DSEC{nonce}:".encode()), _Scan(f"\036DSEC{nonce}:".encode())]
        self._result = asyncio.get_running_loop().create_future()
        e.pgid = self.proc.pid
        quoted = cmd.replace("'", "'\\''")
        script = (f"__dsec_c='{quoted}'; {{ eval \"$__dsec_c\"; }} </dev/null; "
                  f"printf '\\036DSEC{nonce}:%d\\n' \"$?\"; unset __dsec_c; "
                  f"printf '\\036DSEC{nonce}:\\n' >&2\n")
        try:
            self.proc.stdin.write(script.encode())
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass   # the shell is gone: _follow resolves the result
        try:
            async with asyncio.timeout(timeout_s or None):
                kind, code = await self._result
        except TimeoutError:   # a timeout ends the whole session
            self.kill()
            await self._ended.wait()
            e.finish(exit_code=-1, sig=signal.SIGKILL, timed_out=True, session_ended=True)
            return
        if kind == "marker":
            e.finish(exit_code=code)
        else:
            e.finish(returncode=code, session_ended=True)

    def kill(self) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid)
