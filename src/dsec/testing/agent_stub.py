"""An in-process stand-in for the in-sandbox agent, for the edge's unit tests (no root, no crun).

`AgentStub` is an asyncio unix-socket server speaking the real wire protocol
(docs/agent-protocol.md, framing from `dsec.agent.protocol`), so the real
`dsec.agent.client.AgentClient` works against it unchanged:

- PING -> PONG (pid 1, protocol version 1: no output credit, Landlock ABI 0); LIST_EXECS -> EXECS.
- EXEC runs `SHELL -c CMD` (default /bin/sh) as a real subprocess of the current user: CWD and
  relative paths resolve under `root` (the sandbox's `/`; default cwd `workdir`), ENV overrides
  the agent's default environment, TIMEOUT_MS kills the process group (EXIT timed_out, signal
  9), CAP truncates each stream, STDIN / KEEP_STDIN feed stdin. Output is streamed as
  STDOUT/STDERR frames and retained for ATTACH until RELEASE. UID/GID are ignored (no root):
  commands and file operations run as whoever runs the tests, and commands see the host's
  filesystem (only the file operations are confined to `root`).
- SESSION: a persistent shell per name, driven with the agent's end markers and syntax check
  (`cd`/`export` persist, EBUSY while busy, a timeout or SESSION_CLOSE ends the session).
- SIGNAL, STDIN, RELEASE, ATTACH, SESSION_CLOSE as the agent does them.
- FILE_READ / FILE_WRITE / LIST / REMOVE / MKDIR under `root` (see `stub_files`); a path that
  leads out of it gets ERROR EACCES.
- REFRESH: ERROR EPERM (device mode only, as in a container); unknown types: ERROR EINVAL.

One connection at a time; a new one replaces the old (the edge restarted), and running
commands carry on, their output retained. `stop()` kills every command and closes the socket,
which is how a fake sandbox "dies".
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from dsec.agent import protocol as P
from dsec.agent.protocol import MsgType, Tag

from . import stub_files as files
from .stub_exec import Conn, Exec, Session, begin_plain, kill_group, run_plain, spawn
from .stub_files import StubError, Tree

log = logging.getLogger("dsec.testing.agent_stub")

STUB_PROTOCOL_VERSION = 1       # the stub sends output unpaced: it does not speak CREDIT (protocol 2)
DEFAULT_CAP = 1 << 20
MAX_CAP = 64 << 20
MAX_RUNNING = 128
MAX_SESSIONS = 32
MAX_RETAINED = 64               # finished, unreleased execs kept; the oldest go first
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class _Fields:
    """Decoded request fields with the agent's checks (EINVAL for wrong sizes and NULs)."""

    def __init__(self, payload: bytes):
        try:
            pairs = P.decode_fields(payload)
        except P.ProtocolError:
            raise StubError(errno.EINVAL, "malformed fields") from None
        self._by_tag: dict[int, list[bytes]] = defaultdict(list)
        for tag, value in pairs:
            self._by_tag[tag].append(value)

    def has(self, tag: int) -> bool:
        return tag in self._by_tag

    def raw(self, tag: int) -> bytes | None:
        values = self._by_tag.get(tag)
        return values[-1] if values else None

    def str(self, tag: int) -> str | None:
        value = self.raw(tag)
        if value is None:
            return None
        if b"\0" in value:
            raise StubError(errno.EINVAL, f"NUL byte in field {tag}")
        return os.fsdecode(value)

    def u32(self, tag: int, default: int) -> int:
        value = self.raw(tag)
        if value is None:
            return default
        if len(value) != 4:
            raise StubError(errno.EINVAL, "integer fields must be 4 bytes")
        return int(P.U32.unpack(value)[0])

    def all(self, tag: int) -> list[bytes]:
        return self._by_tag.get(tag, [])


class AgentStub:
    def __init__(self, socket_path: str | Path, root: str | Path, *, workdir: str = "/work",
                 shell: str = "/bin/sh"):
        self.socket_path = Path(socket_path)
        self.tree = Tree(Path(root), workdir)
        self.shell = shell
        self.execs: dict[int, Exec] = {}
        self.sessions: dict[str, Session] = {}
        self.connections = 0             # accepted so far (tests check reconnects)
        self._conn: Conn | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._groups: set[int] = set()   # process groups of plain execs (background children too)

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        """Listen on socket_path (again, after suspend()); creates root and workdir."""
        self.tree.cwd(None).mkdir(parents=True, exist_ok=True)
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path),
                                                       limit=P.MAX_PAYLOAD + P.HEADER_SIZE)

    async def suspend(self) -> None:
        """Stop listening and drop the connection; commands carry on (a parked sandbox)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.socket_path.unlink(missing_ok=True)

    async def stop(self) -> None:
        """Kill every command and session, close the socket. Idempotent."""
        await self.suspend()
        for pgid in self._groups:
            kill_group(pgid)
        self._groups.clear()
        for s in self.sessions.values():
            s.closing = True
            s.kill()
        tasks = list(self._tasks)
        if tasks:   # killed commands end on their own within ms; cancel what does not
            _, late = await asyncio.wait(tasks, timeout=2.0)
            for t in late:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.execs.clear()
        self.sessions.clear()

    def _own(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the connection ------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:   # accepted just before suspend()/stop()
            writer.close()
            return
        me = asyncio.current_task()
        if me is not None:   # owned like every other task: stop() waits for it
            self._tasks.add(me)
            me.add_done_callback(self._tasks.discard)
        conn = Conn(writer)
        if self._conn is not None:
            self._conn.close()
        self._conn = conn
        self.connections += 1
        try:
            while conn.live:
                head = await reader.readexactly(P.HEADER_SIZE)
                length, type_, _flags, _reserved, chan = P.HEADER.unpack(head)
                if length > P.MAX_PAYLOAD:   # cannot resynchronise: say so and hang up
                    conn.send(MsgType.ERROR, chan, P.encode_error(errno.EMSGSIZE, f"frame of {length} bytes"))
                    break
                payload = await reader.readexactly(length) if length else b""
                try:
                    await self._dispatch(conn, type_, chan, payload)
                except StubError as e:
                    conn.send(MsgType.ERROR, chan, P.encode_error(e.errno, e.message))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            conn.close()
            if self._conn is conn:
                self._conn = None

    async def _dispatch(self, conn: Conn, type_: int, chan: int, payload: bytes) -> None:
        if type_ == MsgType.PING:
            conn.send(MsgType.PONG, chan, P.PONG_PAYLOAD.pack(1, STUB_PROTOCOL_VERSION) + P.U32.pack(0))
        elif type_ == MsgType.LIST_EXECS:
            body = b"".join(P.EXECS_ENTRY.pack(c, e.finished) for c, e in self.execs.items())
            conn.send(MsgType.EXECS, chan, body)
        elif type_ == MsgType.STDIN:
            await self._stdin(chan, payload)
        elif type_ == MsgType.SIGNAL:
            self._signal(chan, payload)
        elif type_ == MsgType.RELEASE:
            self._release(chan)
        elif type_ == MsgType.ATTACH:
            e = self.execs.get(chan)
            if e is None:
                raise StubError(errno.ENOENT, f"no exec on chan {chan}")
            e.attach(conn)
        elif type_ == MsgType.EXEC:
            await self._exec(conn, chan, _Fields(payload))
        elif type_ in _FILE_OPS:
            _FILE_OPS[type_](self, conn, chan, _Fields(payload))
        elif type_ == MsgType.REFRESH:
            raise StubError(errno.EPERM, "REFRESH is for device mode (VM guests) only")
        else:
            raise StubError(errno.EINVAL, f"unknown frame type {type_}")

    # -- execs ---------------------------------------------------------------------------
    async def _exec(self, conn: Conn, chan: int, f: _Fields) -> None:
        if chan == 0:
            raise StubError(errno.EINVAL, "EXEC needs a non-zero chan")
        old = self.execs.get(chan)
        if old is not None and not old.finished:
            raise StubError(errno.EEXIST, f"chan {chan} is running")
        uid, timeout_ms = f.u32(Tag.UID, 1000), f.u32(Tag.TIMEOUT_MS, 0)
        cap, keep_stdin = min(f.u32(Tag.CAP, DEFAULT_CAP), MAX_CAP), bool(f.u32(Tag.KEEP_STDIN, 0))
        cmd = f.str(Tag.CMD)
        if cmd is None:
            raise StubError(errno.EINVAL, "EXEC without CMD")
        if sum(not e.finished for e in self.execs.values()) >= MAX_RUNNING:
            raise StubError(errno.EAGAIN, f"too many running commands ({MAX_RUNNING})")
        cwd_field = f.str(Tag.CWD)
        if cwd_field is not None and not cwd_field.startswith("/"):
            raise StubError(errno.EINVAL, "CWD must be an absolute path")
        cwd = self.tree.cwd(cwd_field)
        env = self._env(f, uid)
        name, stdin = f.str(Tag.SESSION), f.raw(Tag.STDIN)
        if name is not None:
            if not 0 < len(name.encode()) <= 256:
                raise StubError(errno.EINVAL, "bad SESSION name")
            if stdin is not None or keep_stdin:
                raise StubError(errno.EINVAL, "STDIN is not supported with SESSION")
            await self._exec_session(conn, chan, name, cmd, cap, timeout_ms, cwd, env)
            return
        try:
            proc = await spawn(self.shell, ["-c", cmd], cwd=cwd, env=env,
                               stdin=stdin is not None or keep_stdin)
        except OSError as spawn_error:   # no EXIT: the command never started
            err = spawn_error.errno or errno.EIO
            raise StubError(err, f"spawn ({cwd_field or self.tree.workdir}): {os.strerror(err)}") from None
        self._groups.add(proc.pid)
        e = self._new_exec(conn, chan, cap)
        begin_plain(e, proc, stdin, keep_stdin)
        e.task = self._own(run_plain(e, proc, timeout_ms / 1000))

    async def _exec_session(self, conn: Conn, chan: int, name: str, cmd: str, cap: int,
                            timeout_ms: int, cwd: Path, env: dict[str, str]) -> None:
        s = self.sessions.get(name)
        if s is not None and s.cur is not None:
            raise StubError(errno.EBUSY, f"session {name} is busy")
        if s is None or s.closing:   # a closed one may not have ended yet: never reuse it
            if len(self.sessions) >= MAX_SESSIONS and s is None:
                raise StubError(errno.EAGAIN, f"too many sessions ({MAX_SESSIONS})")
            s = self.sessions[name] = Session(name, self.shell, self._session_ended, self._own)
        e = self._new_exec(conn, chan, cap)
        s.cur = e
        e.task = self._own(self._guard(e, s.run(e, cmd, timeout_ms / 1000, cwd, env)))

    async def _guard(self, e: Exec, coro: Coroutine[Any, Any, None]) -> None:
        """A command that cannot start answers ERROR and leaves no exec behind."""
        try:
            await coro
        except OSError as err:
            code = err.errno or errno.EIO
            if e.conn is not None:
                e.conn.send(MsgType.ERROR, e.chan, P.encode_error(code, f"spawn: {os.strerror(code)}"))
            if self.execs.get(e.chan) is e:
                del self.execs[e.chan]

    def _session_ended(self, s: Session) -> None:
        if self.sessions.get(s.name) is s:
            del self.sessions[s.name]

    def _new_exec(self, conn: Conn, chan: int, cap: int) -> Exec:
        e = Exec(chan, cap, conn, self._exec_done)
        self.execs[chan] = e   # replaces a finished, unreleased one
        return e

    def _exec_done(self, e: Exec) -> None:
        if e.group is not None and not _group_alive(e.group):
            self._groups.discard(e.group)   # never signal a pid that may be reused
        if e.release_when_done and self.execs.get(e.chan) is e:
            del self.execs[e.chan]
        finished = [c for c, x in self.execs.items() if x.finished]
        for c in finished[: max(0, len(finished) - MAX_RETAINED)]:   # dict order: oldest first
            del self.execs[c]

    def _env(self, f: _Fields, uid: int) -> dict[str, str]:
        user = "root" if uid == 0 else "sandbox"
        env = {"PATH": DEFAULT_PATH, "HOME": str(self.tree.cwd(None)), "USER": user,
               "LOGNAME": user, "LANG": "C.UTF-8", "TERM": "dumb"}
        values = f.all(Tag.ENV)
        if len(values) > 4096:
            raise StubError(errno.E2BIG, "too many ENV fields")
        for raw in values:
            key, eq, value = raw.partition(b"=")
            if not eq or not key or b"\0" in raw:
                raise StubError(errno.EINVAL, "ENV must be KEY=VALUE without NUL bytes")
            env[os.fsdecode(key)] = os.fsdecode(value)
        return env

    async def _stdin(self, chan: int, data: bytes) -> None:
        e = self.execs.get(chan)
        if e is None or e.stdin is None:
            return
        try:
            if data:
                e.stdin.write(data)
                await e.stdin.drain()
            else:
                e.stdin.close()
                e.stdin = None
        except (BrokenPipeError, ConnectionResetError):
            e.stdin = None

    def _signal(self, chan: int, payload: bytes) -> None:
        e = self.execs.get(chan)
        if e is None:
            raise StubError(errno.ENOENT, f"no exec on chan {chan}")
        if len(payload) != 4 or not 1 <= P.U32.unpack(payload)[0] < 65:
            raise StubError(errno.EINVAL, "SIGNAL needs a u32 signal number")
        e.signal(P.U32.unpack(payload)[0])

    def _release(self, chan: int) -> None:
        e = self.execs.get(chan)
        if e is None:
            return
        if e.finished:
            del self.execs[chan]
        else:
            e.release_when_done = True

    # -- files ---------------------------------------------------------------------------
    def _file_read(self, conn: Conn, chan: int, f: _Fields) -> None:
        data = files.read(self.tree, self._path(f), f.u32(Tag.MAXLEN, 64 << 20))
        for i in range(0, len(data), P.MAX_DATA_CHUNK):
            conn.send(MsgType.DATA, chan, data[i : i + P.MAX_DATA_CHUNK])
        conn.send(MsgType.OK, chan, P.U64.pack(len(data)))

    def _file_write(self, conn: Conn, chan: int, f: _Fields) -> None:
        files.write(self.tree, self._path(f), f.raw(Tag.DATA) or b"", f.u32(Tag.MODE, 0o644),
                    bool(f.u32(Tag.MKDIRS, 0)))
        conn.send(MsgType.OK, chan)

    def _list(self, conn: Conn, chan: int, f: _Fields) -> None:
        conn.send(MsgType.LISTING, chan, files.listing(self.tree, self._path(f)))

    def _remove(self, conn: Conn, chan: int, f: _Fields) -> None:
        files.remove(self.tree, self._path(f))
        conn.send(MsgType.OK, chan)

    def _mkdir(self, conn: Conn, chan: int, f: _Fields) -> None:
        files.mkdir(self.tree, self._path(f), f.u32(Tag.MODE, 0o755))
        conn.send(MsgType.OK, chan)

    def _session_close(self, conn: Conn, chan: int, f: _Fields) -> None:
        name = f.str(Tag.SESSION)
        if not name:
            raise StubError(errno.EINVAL, "SESSION_CLOSE needs SESSION")
        s = self.sessions.get(name)
        if s is not None:
            s.closing = True
            s.kill()
            if not s.alive and s.cur is None:
                del self.sessions[name]
        conn.send(MsgType.OK, chan)

    def _path(self, f: _Fields) -> str:
        for tag in (Tag.UID, Tag.GID):   # ignored, but checked as the agent does
            f.u32(tag, 0)
        path = f.str(Tag.PATH)
        if not path:
            raise StubError(errno.EINVAL, "bad PATH")
        return path


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


_FILE_OPS: dict[int, Callable[[AgentStub, Conn, int, _Fields], None]] = {
    MsgType.FILE_READ: AgentStub._file_read, MsgType.FILE_WRITE: AgentStub._file_write,
    MsgType.LIST: AgentStub._list, MsgType.REMOVE: AgentStub._remove,
    MsgType.MKDIR: AgentStub._mkdir, MsgType.SESSION_CLOSE: AgentStub._session_close,
}
