"""asyncio client for the in-sandbox agent, used by the edge.

One connection carries many concurrent requests: a single reader task demultiplexes
incoming frames by chan into per-request queues. Exec chans are chosen by the caller
(1 .. 0x7fffffff); file operations and pings use chans allocated here from 0x80000000
upward so they never collide. When the connection dies, every pending request raises
AgentDisconnected; errors reported by the agent raise AgentError(errno, message).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from . import protocol as P
from .protocol import MsgType, Tag

log = logging.getLogger("dsec.agent")

INTERNAL_CHAN_BASE = 0x80000000
_CHAN_MAX = 0xFFFFFFFF
_STDIN_CHUNK = 1 << 20
_GONE = object()  # queue sentinel: the connection is gone
_OVERFLOW = object()  # queue sentinel: a capped chan's reader fell too far behind
OVERFLOWED = -1       # _next's frame type for _OVERFLOW
WATCH_QUEUE_BYTES = 1 << 20   # unread events one watch may hold here (issue 22: a watch nobody
                              # read grew the apiserver by 1.27 GB in 36 s)
EXEC_WINDOW = 512 << 10       # exec output one chan may hold here unread (agents of protocol >= 2);
                              # the rest waits in the agent, within the exec's cap

# An exec whose EXIT has not come this long after its timeout (the agent kills at the timeout
# and reports within ~2 s) is looked for in the agent's LIST_EXECS, again every as often.
EXEC_LOST_CHECK_S = 10.0


class _ChanQueue(asyncio.Queue):
    """A chan's frames. With `cap`, at most that many payload bytes wait unread; past it the
    reader gets OVERFLOWED once and nothing more (the caller ends the chan). `credited`: the
    agent sends this exec chan's output against credit (EXEC_WINDOW), returned as it is read."""

    def __init__(self, chan: int, cap: int | None = None, credited: bool = False):
        super().__init__()
        self.chan = chan
        self.cap = cap
        self.held = 0
        self.overflowed = False
        self.credited = credited
        self.ended = False        # its EXIT (or ERROR) was read: nothing more comes


class AgentError(Exception):
    """The agent answered ERROR."""

    def __init__(self, errno: int, message: str):
        super().__init__(errno, message)
        self.errno = errno
        self.message = message

    def __str__(self) -> str:
        name = os.strerror(self.errno) if self.errno > 0 else "error"
        return f"[{self.errno}] {name}: {self.message}"


class AgentDisconnected(ConnectionError):
    """The connection to the agent is closed (or could not be opened)."""


class ExecLost(Exception):
    """The agent no longer has an exec whose result was still awaited (it will never come)."""


@dataclass
class Output:
    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass
class Exit:
    exit_code: int | None  # None if killed by a signal
    signal: int | None  # None if it exited
    timed_out: bool
    truncated: bool
    session_ended: bool
    stdout_total: int
    stderr_total: int


@dataclass
class DirEntry:
    name: str
    kind: Literal["file", "dir", "symlink", "other"]
    mode: int
    size: int
    mtime: float


@dataclass
class Change:
    """One change below a watched directory (fsnotify's names, as E2B's envd reports them)."""
    kind: Literal["create", "write", "remove", "rename", "chmod", "overflow"]
    name: str          # relative to the watched directory; "" for overflow
    is_dir: bool


def _change_from_wire(mask: int, name: bytes) -> Change | None:
    if mask & P.IN_Q_OVERFLOW:
        return Change("overflow", "", False)
    kind: Literal["create", "write", "remove", "rename", "chmod"]
    if mask & (P.IN_CREATE | P.IN_MOVED_TO):
        kind = "create"
    elif mask & P.IN_DELETE:
        kind = "remove"
    elif mask & P.IN_MOVED_FROM:
        kind = "rename"
    elif mask & P.IN_MODIFY:
        kind = "write"
    elif mask & P.IN_ATTRIB:
        kind = "chmod"
    else:
        return None
    return Change(kind, os.fsdecode(name), bool(mask & P.IN_ISDIR))


def _exit_from_wire(info: P.ExitInfo) -> Exit:
    signalled = info.signal != 0
    return Exit(
        exit_code=None if signalled else info.exit_code,
        signal=info.signal if signalled else None,
        timed_out=info.timed_out,
        truncated=info.truncated,
        session_ended=info.session_ended,
        stdout_total=info.stdout_total,
        stderr_total=info.stderr_total,
    )


class AgentClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer
        self._queues: dict[int, _ChanQueue] = {}
        self._next_chan = INTERNAL_CHAN_BASE
        self._closed = False
        self._reason = "connection closed"
        self.protocol_version = 1      # known after the first PONG (connect() pings)
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(cls, socket_path: str | Path, timeout: float = 5.0) -> "AgentClient":
        """Connect to the agent's socket and check it answers PING."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(socket_path), limit=1 << 20), timeout
            )
        except (OSError, asyncio.TimeoutError) as e:
            raise AgentDisconnected(f"cannot connect to agent at {socket_path}: {e!r}") from e
        client = cls(reader, writer)
        try:
            await client._ping_until(asyncio.get_running_loop().time() + timeout)
        except asyncio.TimeoutError as e:
            await client.close()
            raise AgentDisconnected(f"agent at {socket_path} did not answer PING") from e
        except BaseException:
            await client.close()
            raise
        return client

    async def _ping_until(self, deadline: float, every: float = 1.0) -> None:
        """PING, again after 50 ms, 100 ms ... then every `every` s, until one is answered. In
        device mode (VMs) a PING that reaches the agent before it has seen the host reconnect
        is dropped as stale input; a new one on a fresh chan is not lost, and a late PONG for
        an old chan is discarded."""
        loop = asyncio.get_running_loop()
        wait = 0.05
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                await asyncio.wait_for(self.ping(), min(wait, left))
                return
            except asyncio.TimeoutError:
                wait = min(wait * 2, every)

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        self._shutdown("closed by client")
        if not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        try:
            await self._writer.wait_closed()
        except Exception:
            pass

    async def __aenter__(self) -> "AgentClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _shutdown(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._reason = reason
        log.debug("agent connection closed: %s", reason)
        try:
            self._writer.close()
        except Exception:
            pass
        for q in self._queues.values():
            q.put_nowait(_GONE)

    async def _read_loop(self) -> None:
        reason = "connection closed by agent"
        try:
            while True:
                head = await self._reader.readexactly(P.HEADER_SIZE)
                length, type_, chan = P.decode_header(head)
                payload = await self._reader.readexactly(length) if length else b""
                q = self._queues.get(chan)
                if q is None:      # nobody waits for it any more (e.g. abandoned exec)
                    continue
                if q.cap is not None:
                    if q.overflowed:
                        continue
                    if q.held + len(payload) > q.cap:
                        q.overflowed = True
                        q.put_nowait(_OVERFLOW)
                        continue
                    q.held += len(payload)
                q.put_nowait((type_, payload))
        except asyncio.IncompleteReadError:
            pass
        except P.ProtocolError as e:
            reason = f"protocol error: {e}"
        except (ConnectionError, OSError) as e:
            reason = f"connection error: {e!r}"
        except asyncio.CancelledError:
            reason = "closed by client"
        finally:
            self._shutdown(reason)

    # ------------------------------------------------------------------ plumbing

    @property
    def credit(self) -> bool:
        """Does the agent pace exec output by credit (protocol >= 2)?"""
        return self.protocol_version >= P.CREDIT_VERSION

    def _register(self, chan: int, cap: int | None = None, credited: bool = False) -> _ChanQueue:
        if self._closed:
            raise AgentDisconnected(self._reason)
        if chan in self._queues:
            raise ValueError(f"chan {chan:#x} is already in use on this connection")
        q = _ChanQueue(chan, cap, credited)
        self._queues[chan] = q
        return q

    def _unregister(self, chan: int, q: _ChanQueue) -> None:
        if self._queues.get(chan) is q:
            del self._queues[chan]
            if q.credited and not q.ended:   # let go: the agent sends the rest unpaced (dropped
                self._grant(chan, P.CREDIT_LET_GO)   # here), so the exec ends and can be evicted

    def _grant(self, chan: int, n: int) -> None:
        """Credit `n` more output bytes to an exec chan (no await: also from cleanup code)."""
        if not self._closed:
            try:
                self._write(MsgType.CREDIT, chan, P.U32.pack(n))
            except AgentDisconnected:
                pass

    def _alloc_chan(self) -> int:
        while True:
            chan = self._next_chan
            self._next_chan = chan + 1 if chan < _CHAN_MAX else INTERNAL_CHAN_BASE
            if chan not in self._queues:
                return chan

    async def _send(self, type_: int, chan: int, *parts: bytes) -> None:
        self._write(type_, chan, *parts)
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            self._shutdown(f"connection error: {e!r}")
            raise AgentDisconnected(self._reason) from e

    def _write(self, type_: int, chan: int, *parts: bytes) -> None:
        """Queue one frame without waiting (for small frames that must go out even from a
        cancelled task's cleanup, e.g. UNWATCH)."""
        if self._closed:
            raise AgentDisconnected(self._reason)
        length = sum(len(p) for p in parts)
        head = P.encode_header(type_, chan, length)
        try:
            # consecutive write() calls without an await in between: frames never interleave
            self._writer.write(head)
            for part in parts:
                if part:
                    self._writer.write(part)
        except (ConnectionError, OSError) as e:
            self._shutdown(f"connection error: {e!r}")
            raise AgentDisconnected(self._reason) from e

    async def _next(self, q: _ChanQueue, timeout: float | None = None) -> tuple[int, bytes]:
        """The next frame of a chan (asyncio.TimeoutError after `timeout` s without one)."""
        if timeout is None or not q.empty():
            item = await q.get()
        else:
            item = await asyncio.wait_for(q.get(), timeout)   # cancelling a get loses no item
        if item is _GONE:
            raise AgentDisconnected(self._reason)
        if item is _OVERFLOW:
            return OVERFLOWED, b""
        type_, payload = item
        if q.cap is not None:
            q.held -= len(payload)
        if q.credited:
            if type_ in (MsgType.STDOUT, MsgType.STDERR) and payload:
                self._grant(q.chan, len(payload))     # read: the agent may send as much again
            elif type_ in (MsgType.EXIT, MsgType.ERROR):
                q.ended = True
        if type_ == MsgType.ERROR:
            raise AgentError(*P.decode_error(payload))
        return type_, payload

    async def _request(self, type_: int, *parts: bytes) -> tuple[int, bytes]:
        """One request on an internal chan, answered by one frame."""
        chan = self._alloc_chan()
        q = self._register(chan)
        try:
            await self._send(type_, chan, *parts)
            return await self._next(q)
        finally:
            self._unregister(chan, q)

    async def _open(self, type_: int, chan: int, *parts: bytes,
                    check_at: float | None = None) -> AsyncIterator[Output | Exit]:
        """Register the chan and send the request now; return the iterator that follows it.
        The request's fields carry WINDOW when the agent paces output by credit."""
        q = self._register(chan, credited=self.credit)
        try:
            await self._send(type_, chan, *parts)
        except BaseException:
            self._unregister(chan, q)
            raise
        return self._follow(chan, q, check_at)

    async def _follow(self, chan: int, q: asyncio.Queue,
                      check_at: float | None = None) -> AsyncIterator[Output | Exit]:
        """Output and Exit of `chan`. From loop time `check_at` on, a wait without frames asks
        the agent whether it still has the exec (every EXEC_LOST_CHECK_S): ExecLost if not."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    t, payload = await self._next(q, None if check_at is None else max(0.0, check_at - loop.time()))
                except asyncio.TimeoutError:
                    assert check_at is not None
                    if chan not in {c for c, _ in await self.list_execs()}:
                        raise ExecLost(f"the agent no longer has exec {chan}: its result was dropped") from None
                    check_at = loop.time() + EXEC_LOST_CHECK_S
                    continue
                if t == MsgType.STDOUT:
                    yield Output("stdout", payload)
                elif t == MsgType.STDERR:
                    yield Output("stderr", payload)
                elif t == MsgType.EXIT:
                    # free the chan before handing out Exit: callers often stop iterating there
                    self._unregister(chan, q)
                    yield _exit_from_wire(P.decode_exit(payload))
                    return
        finally:
            self._unregister(chan, q)

    def _window(self) -> bytes:
        """The WINDOW field of EXEC and ATTACH (empty for agents without credit)."""
        return P.encode_field(Tag.WINDOW, EXEC_WINDOW) if self.credit else b""

    async def _stream(self, type_: int, chan: int, *parts: bytes) -> AsyncIterator[Output | Exit]:
        """Lazy form: the request is sent when iteration starts."""
        follow = await self._open(type_, chan, *parts)
        async for item in follow:
            yield item

    @staticmethod
    def _check_exec_chan(chan: int) -> None:
        if not 0 < chan < INTERNAL_CHAN_BASE:
            raise ValueError(f"exec chan must be in 1..{INTERNAL_CHAN_BASE - 1:#x}, got {chan}")

    # ------------------------------------------------------------------ API

    async def ping(self) -> None:
        _, payload = await self._request(MsgType.PING)
        _, self.protocol_version = P.decode_pong(payload)

    async def landlock_abi(self) -> int:
        """The Landlock ABI version the agent confines commands with (0: Landlock not used)."""
        _, payload = await self._request(MsgType.PING)
        P.decode_pong(payload)
        return P.decode_pong_landlock(payload)

    def exec(self, chan: int, **kw: Any) -> AsyncIterator[Output | Exit]:
        """Run a command (arguments: see _exec_parts); yields Output items as they arrive, the
        last item is Exit. The EXEC frame is sent when iteration starts."""
        return self._stream(MsgType.EXEC, chan, *self._exec_parts(chan, **kw))

    async def start_exec(self, chan: int, **kw: Any) -> AsyncIterator[Output | Exit]:
        """Like exec(), but the EXEC frame is sent before this returns: once it has returned,
        the command runs even if the caller dies (the edge relies on that across restarts).
        With a timeout, an EXIT still missing EXEC_LOST_CHECK_S after it raises ExecLost if the
        agent no longer has the exec (a result never to come is not waited for forever)."""
        timeout_ms = kw.get("timeout_ms", 0)
        check_at = asyncio.get_running_loop().time() + timeout_ms / 1000 + EXEC_LOST_CHECK_S if timeout_ms else None
        return await self._open(MsgType.EXEC, chan, *self._exec_parts(chan, **kw), check_at=check_at)

    def _exec_parts(
        self,
        chan: int,
        *,
        cmd: str,
        uid: int,
        gid: int,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_ms: int = 0,
        cap: int = 1 << 20,
        session: str | None = None,
        stdin: bytes | None = None,
        keep_stdin: bool = False,
        pty: tuple[int, int] | None = None,
    ) -> tuple[bytes, ...]:
        """The EXEC request for `cmd` run as uid/gid (cwd, env, timeout, output cap per stream,
        session name, stdin bytes, keep stdin open for STDIN frames; pty (cols, rows): on a
        terminal of that size, its output as stdout, STDIN frames typed into it)."""
        self._check_exec_chan(chan)
        if pty is not None and self.protocol_version < P.PTY_VERSION:
            raise AgentError(95, f"this sandbox's agent speaks protocol {self.protocol_version}, PTYs need "
                                 f"{P.PTY_VERSION}: it was started before dsec had PTYs")
        fields: list[tuple[int, P.FieldValue]] = [
            (Tag.CMD, cmd), (Tag.UID, uid), (Tag.GID, gid),
            (Tag.TIMEOUT_MS, timeout_ms), (Tag.CAP, cap),
        ]
        if cwd is not None:
            fields.append((Tag.CWD, cwd))
        for key, value in (env or {}).items():
            fields.append((Tag.ENV, f"{key}={value}"))
        if session is not None:
            fields.append((Tag.SESSION, session))
        if keep_stdin:
            fields.append((Tag.KEEP_STDIN, 1))
        if pty is not None:
            fields.append((Tag.PTY, P.PTY_SIZE.pack(*pty)))
        head = P.encode_fields(fields) + self._window()
        if stdin is not None:  # sent without copying the data into one buffer
            head += P.FIELD_HEAD.pack(Tag.STDIN, len(stdin))
            return head, bytes(stdin)
        return (head,)

    def attach(self, chan: int) -> AsyncIterator[Output | Exit]:
        """Replay the retained output of `chan` (stdout, then stderr), then follow it live."""
        self._check_exec_chan(chan)
        return self._stream(MsgType.ATTACH, chan, self._window())

    async def release(self, chan: int) -> None:
        await self._send(MsgType.RELEASE, chan)

    async def signal(self, chan: int, sig: int) -> None:
        await self._send(MsgType.SIGNAL, chan, P.U32.pack(int(sig)))

    async def resize(self, chan: int, cols: int, rows: int) -> None:
        """New size of a PTY exec's terminal (ignored by the agent for other execs)."""
        await self._send(MsgType.RESIZE, chan, P.PTY_SIZE.pack(cols, rows))

    async def send_stdin(self, chan: int, data: bytes) -> None:
        """Feed stdin of a KEEP_STDIN exec; b"" closes it."""
        if not data:
            await self._send(MsgType.STDIN, chan)
            return
        view = memoryview(data)
        for i in range(0, len(view), _STDIN_CHUNK):
            await self._send(MsgType.STDIN, chan, bytes(view[i : i + _STDIN_CHUNK]))

    async def read_file(self, path: str, *, uid: int, gid: int, maxlen: int = 64 << 20) -> bytes:
        chan = self._alloc_chan()
        q = self._register(chan)
        try:
            payload = P.encode_fields([(Tag.PATH, path), (Tag.UID, uid), (Tag.GID, gid), (Tag.MAXLEN, maxlen)])
            await self._send(MsgType.FILE_READ, chan, payload)
            buf = bytearray()
            while True:
                t, data = await self._next(q)
                if t == MsgType.DATA:
                    buf += data
                    if len(buf) > maxlen:
                        raise P.ProtocolError("agent sent more than MAXLEN bytes")
                elif t == MsgType.OK:
                    total = P.decode_ok_total(data)
                    if total is not None and total != len(buf):
                        raise P.ProtocolError(f"FILE_READ total {total} != {len(buf)} bytes received")
                    return bytes(buf)
        finally:
            self._unregister(chan, q)

    async def write_file(
        self, path: str, data: bytes, *, uid: int, gid: int, mode: int = 0o644, mkdirs: bool = True
    ) -> None:
        head = P.encode_fields(
            [(Tag.PATH, path), (Tag.UID, uid), (Tag.GID, gid), (Tag.MODE, mode), (Tag.MKDIRS, int(mkdirs))]
        )
        head += P.FIELD_HEAD.pack(Tag.DATA, len(data))
        if len(head) + len(data) > P.MAX_PAYLOAD:
            raise ValueError(f"file of {len(data)} bytes is too large for one FILE_WRITE")
        await self._request(MsgType.FILE_WRITE, head, bytes(data))

    async def list_dir(self, path: str, *, uid: int, gid: int) -> list[DirEntry]:
        _, payload = await self._request(
            MsgType.LIST, P.encode_fields([(Tag.PATH, path), (Tag.UID, uid), (Tag.GID, gid)])
        )
        entries = [
            DirEntry(
                name=os.fsdecode(e.name),
                kind=P.KIND_NAMES.get(e.kind, "other"),  # type: ignore[arg-type]
                mode=e.mode,
                size=e.size,
                mtime=e.mtime_ns / 1e9,
            )
            for e in P.decode_listing(payload)
        ]
        entries.sort(key=lambda e: e.name)
        return entries

    async def remove(self, path: str, *, uid: int, gid: int) -> None:
        await self._request(MsgType.REMOVE, P.encode_fields([(Tag.PATH, path), (Tag.UID, uid), (Tag.GID, gid)]))

    async def mkdir(self, path: str, *, uid: int, gid: int, mode: int = 0o755) -> None:
        await self._request(
            MsgType.MKDIR, P.encode_fields([(Tag.PATH, path), (Tag.UID, uid), (Tag.GID, gid), (Tag.MODE, mode)])
        )

    async def watch(self, path: str, *, uid: int, gid: int, recursive: bool = False) -> "WatchStream":
        """Watch directory `path` (its tree with `recursive`) as uid/gid. Returns once the agent
        has the watch in place (AgentError if it refused); the stream then yields the changes
        as they come, in batches, until it is closed (which ends the watch in the agent) or the
        directory is removed (AgentError ENOENT)."""
        chan = self._alloc_chan()
        q = self._register(chan, cap=WATCH_QUEUE_BYTES)
        try:
            await self._send(MsgType.WATCH, chan, P.encode_fields(
                [(Tag.PATH, path), (Tag.UID, uid), (Tag.GID, gid), (Tag.RECURSIVE, int(recursive))]))
            t, _ = await self._next(q)
            if t != MsgType.OK:
                raise P.ProtocolError(f"WATCH answered with frame type {t}")
        except BaseException:
            self._unregister(chan, q)
            raise
        return WatchStream(self, chan, q)

    async def refresh(self, *, seed: bytes, time_ns: int) -> None:
        """VM guests only: set the guest clock and reseed its CRNG (a restored guest is a copy)."""
        await self._request(MsgType.REFRESH, P.encode_fields([(Tag.TIME_NS, P.U64.pack(time_ns)), (Tag.DATA, seed)]))

    async def close_session(self, name: str) -> None:
        await self._request(MsgType.SESSION_CLOSE, P.encode_fields([(Tag.SESSION, name)]))

    async def list_execs(self) -> list[tuple[int, bool]]:
        _, payload = await self._request(MsgType.LIST_EXECS)
        return P.decode_execs(payload)


class WatchStream:
    """The changes of one WATCH, in batches. aclose() ends the watch in the agent, whether or
    not iteration ever started (an async generator's cleanup would not run then)."""

    def __init__(self, client: AgentClient, chan: int, q: asyncio.Queue):
        self._client = client
        self._chan = chan
        self._q = q
        self._done = False

    def __aiter__(self) -> "WatchStream":
        return self

    async def __anext__(self) -> list[Change]:
        while not self._done:
            try:
                t, payload = await self._client._next(self._q)
            except (AgentError, AgentDisconnected):
                self._finish()      # the agent ended the watch, or the connection went
                raise
            if t == OVERFLOWED:          # its reader fell WATCH_QUEUE_BYTES behind: end the watch
                await self.aclose()
                return [Change("overflow", "", False)]
            if t == MsgType.EVENT:
                batch = [c for m, n in P.decode_events(payload) if (c := _change_from_wire(m, n)) is not None]
                if batch:
                    return batch
        raise StopAsyncIteration

    def _finish(self) -> None:
        self._done = True
        self._client._unregister(self._chan, self._q)

    async def aclose(self) -> None:
        """Never suspends: it also runs in the cleanup of a cancelled request (a client that
        went away), where any await would be cancelled again and the watch left in the agent."""
        if self._done:
            return
        self._finish()
        if not self._client.closed:
            try:
                self._client._write(MsgType.UNWATCH, self._chan)
            except AgentDisconnected:
                pass
