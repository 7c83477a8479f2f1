"""envd's `process.Process` Connect service on dsec's exec-control API.

A process is a dsec exec started detached (edge.exec_start); its E2B pid is the exec id.
Output streams from edge.exec_follow (replayed from the beginning, then live); stdin, signals
and the list go to exec_stdin / exec_signal / list_execs. A PTY (StartRequest.pty) is an exec
on a terminal: its output comes as `pty` data (bytes), `pty` input is typed into it, Update
resizes it (exec_resize).
"""

from __future__ import annotations

import base64
import shlex
from collections.abc import AsyncIterator

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import ProcessASGIApplication

from dsec.apiserver.context import ApiContext
from dsec.apiserver.e2b.control import check_exec
from dsec.apiserver.e2b.envd_common import (Target, abs_path, account, keepalive_s, target_of, user_of,
                                            with_keepalive)
from dsec.apiserver.e2b.errors import connect_error
from dsec.apiserver.e2b.mapping import E2B_USER_ENV
from dsec.types import MAX_EXEC_TIMEOUT_S, DsecError, ExecEvent, ExecInfo, ExecRequest, ExecResult, PtySize

SHELLS = {"/bin/bash", "bash", "/bin/sh", "sh", "/usr/bin/bash", "/bin/ash", "ash"}
SIGNALS = {pb.Signal.SIGKILL: 9, pb.Signal.SIGTERM: 15}


def shell_command(cmd: str, args: list[str]) -> str:
    """The command line dsec runs with the image's shell. The SDK sends `/bin/bash -l -c SCRIPT`:
    the script alone is run (images such as busybox have no bash)."""
    if cmd in SHELLS and len(args) >= 2 and args[-2] == "-c" and all(a.startswith("-") for a in args[:-1]):
        return args[-1]
    return shlex.join([cmd, *args])


def pty_command(cmd: str, args: list[str]) -> str:
    """A terminal's shell: the SDK asks for `/bin/bash -i -l`; images without bash (busybox)
    get their sh with the same flags. `exec`: the shell is the terminal's session leader."""
    if cmd in SHELLS and all(a.startswith("-") for a in args):
        flags = shlex.join(args)
        return (f'if command -v {shlex.quote(cmd)} >/dev/null 2>&1; then exec {shlex.quote(cmd)} {flags}; '
                f'else exec /bin/sh {flags}; fi')
    return "exec " + shlex.join([cmd, *args])


def pty_size(pty: pb.PTY | None) -> PtySize:
    size = pty.size if pty is not None else None
    if size is None or not 0 < size.cols <= 4096 or not 0 < size.rows <= 4096:
        raise ConnectError(Code.INVALID_ARGUMENT, "pty.size needs cols and rows in 1..4096")
    return PtySize(cols=size.cols, rows=size.rows)


def exec_request(req: pb.StartRequest, user: str | None) -> ExecRequest:
    proc = req.process or pb.ProcessConfig()
    if not proc.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is empty")
    # unset: the sandbox's workdir (/home/user, the default user's home, for E2B's sandboxes)
    cwd = abs_path(proc.cwd, "cwd", user) if proc.has_field("cwd") and proc.cwd else None
    env = {**(E2B_USER_ENV if user is None else {}), **proc.envs}
    tag = req.tag if req.has_field("tag") and req.tag else None
    if req.pty is not None:
        size = pty_size(req.pty)
        try:
            return ExecRequest(cmd=pty_command(proc.cmd, list(proc.args)), cwd=cwd, env=env, tag=tag,
                               pty=size, user=user, timeout_s=MAX_EXEC_TIMEOUT_S)
        except ValueError as e:
            raise ConnectError(Code.INVALID_ARGUMENT, f"invalid process: {e}") from None
    # stdin unset: older SDKs expect it open (envd's default)
    keep_stdin = req.stdin if req.has_field("stdin") else True
    try:
        # E2B bounds a command only by the client's stream deadline and the sandbox's life
        return ExecRequest(cmd=shell_command(proc.cmd, list(proc.args)), cwd=cwd, env=env, tag=tag,
                           keep_stdin=keep_stdin, user=user, timeout_s=MAX_EXEC_TIMEOUT_S)
    except ValueError as e:       # pydantic: tag, env names, cwd
        raise ConnectError(Code.INVALID_ARGUMENT, f"invalid process: {e}") from None


def _event(ev: pb.ProcessEvent, start: bool) -> pb.StartResponse | pb.ConnectResponse:
    return pb.StartResponse(event=ev) if start else pb.ConnectResponse(event=ev)


def end_event(result: ExecResult | None, error: str | None) -> pb.ProcessEvent:
    """envd's EndEvent: exit code, `exited` (False when a signal ended it), status text."""
    if result is None:
        return pb.ProcessEvent(event=Oneof("end", pb.ProcessEvent.EndEvent(
            exit_code=-1, exited=False, status="lost", error=error or "the command ended without a result")))
    if result.exit_code is None:
        sig = result.signal or 0
        status = "timeout" if result.timed_out else f"signal: {sig}"
        return pb.ProcessEvent(event=Oneof("end", pb.ProcessEvent.EndEvent(
            exit_code=-1, exited=False, status=status, error=status)))
    end = pb.ProcessEvent.EndEvent(exit_code=result.exit_code, exited=True, status=f"exit status {result.exit_code}")
    if result.exit_code != 0 and result.stderr:
        end.error = f"exit status {result.exit_code}"
    return pb.ProcessEvent(event=Oneof("end", end))


def _data(ev: ExecEvent) -> pb.ProcessEvent:
    data = base64.b64decode(ev.data) if ev.type == "pty" else ev.data.encode()
    return pb.ProcessEvent(event=Oneof("data", pb.ProcessEvent.DataEvent(output=Oneof(ev.type, data))))


class ProcessService:
    """process.Process for the sandbox named by each request's E2b-Sandbox-Id header."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx

    async def _target(self, rc: RequestContext) -> Target:
        try:
            return await target_of(self.ctx, rc.request_headers)
        except DsecError as e:
            raise connect_error(e) from None

    async def _pid(self, t: Target, selector: pb.ProcessSelector | None) -> str:
        """The exec id a selector names (a pid, or the tag of a running process)."""
        sel = selector.selector if selector is not None else None
        match sel:
            case Oneof(field="pid", value=pid):
                return str(pid)
            case Oneof(field="tag", value=tag):
                for info in await t.edge.list_execs(t.sandbox_id):
                    if info.tag == tag:
                        return info.exec_id
                raise ConnectError(Code.NOT_FOUND, f"process with tag {tag!r} not found")
        raise ConnectError(Code.INVALID_ARGUMENT, "process selector is empty: pass a pid or a tag")

    def start(self, request: pb.StartRequest, ctx: RequestContext) -> AsyncIterator[pb.StartResponse]:
        return self._run(request, ctx)

    async def _run(self, request: pb.StartRequest, ctx: RequestContext) -> AsyncIterator[pb.StartResponse]:
        t = await self._target(ctx)
        try:
            req = exec_request(request, await account(t, user_of(ctx.request_headers)))
            check_exec(self.ctx, t.info.project, req)
            info = await t.edge.exec_start(t.sandbox_id, req)
        except DsecError as e:
            raise connect_error(e) from None
        async for msg in self._follow(t, info.exec_id, ctx, start=True):
            yield msg   # type: ignore[misc]

    def connect(self, request: pb.ConnectRequest, ctx: RequestContext) -> AsyncIterator[pb.ConnectResponse]:
        return self._connect(request, ctx)

    async def _connect(self, request: pb.ConnectRequest, ctx: RequestContext) -> AsyncIterator[pb.ConnectResponse]:
        t = await self._target(ctx)
        pid = await self._pid(t, request.process)
        async for msg in self._follow(t, pid, ctx, start=False):
            yield msg   # type: ignore[misc]

    async def _follow(self, t: Target, exec_id: str, ctx: RequestContext, start: bool
                      ) -> AsyncIterator[pb.StartResponse | pb.ConnectResponse]:
        """start{pid}, data events (from the beginning), end; keepalives in silences. The
        edge's own start event comes first, so that a bad pid fails before E2B's start."""
        events = t.edge.exec_follow(t.sandbox_id, exec_id)
        try:
            await anext(events)
        except DsecError as e:
            raise _process_error(e, exec_id) from None
        yield _event(pb.ProcessEvent(event=Oneof("start", pb.ProcessEvent.StartEvent(pid=int(exec_id)))), start)
        try:
            async for ev in with_keepalive(events, keepalive_s(ctx.request_headers)):
                if ev is None:
                    yield _event(pb.ProcessEvent(event=Oneof("keepalive", pb.ProcessEvent.KeepAlive())), start)
                elif ev.type in ("stdout", "stderr", "pty") and ev.data:
                    yield _event(_data(ev), start)
                elif ev.type == "exit":
                    yield _event(end_event(ev.result, ev.data), start)
                    return
        except DsecError as e:
            raise connect_error(e) from None

    async def list(self, request: pb.ListRequest, ctx: RequestContext) -> pb.ListResponse:
        t = await self._target(ctx)
        try:
            execs = await t.edge.list_execs(t.sandbox_id)
        except DsecError as e:
            raise connect_error(e) from None
        return pb.ListResponse(processes=[_process_info(i) for i in execs if i.exec_id.isdigit()])

    async def send_input(self, request: pb.SendInputRequest, ctx: RequestContext) -> pb.SendInputResponse:
        t = await self._target(ctx)
        pid = await self._pid(t, request.process)
        await self._stdin(t, pid, _stdin_bytes(request.input))
        return pb.SendInputResponse()

    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest], ctx: RequestContext
                           ) -> pb.StreamInputResponse:
        t = await self._target(ctx)
        pid: str | None = None
        async for msg in request:
            match msg.event:
                case Oneof(field="start", value=start):
                    pid = await self._pid(t, start.process)
                case Oneof(field="data", value=data):
                    if pid is None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "stream input sent data before its start event")
                    await self._stdin(t, pid, _stdin_bytes(data.input))
        return pb.StreamInputResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: RequestContext) -> pb.CloseStdinResponse:
        t = await self._target(ctx)
        pid = await self._pid(t, request.process)
        await self._stdin(t, pid, b"", close=True)
        return pb.CloseStdinResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx: RequestContext) -> pb.SendSignalResponse:
        t = await self._target(ctx)
        pid = await self._pid(t, request.process)
        sig = SIGNALS.get(request.signal)
        if sig is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"signal {request.signal} is not SIGTERM or SIGKILL")
        try:
            await t.edge.exec_signal(t.sandbox_id, pid, sig)
        except DsecError as e:
            raise _process_error(e, pid) from None
        return pb.SendSignalResponse()

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext) -> pb.UpdateResponse:
        """envd's Update: a PTY's new size (the only thing it updates)."""
        t = await self._target(ctx)
        pid = await self._pid(t, request.process)
        size = pty_size(request.pty)
        try:
            await t.edge.exec_resize(t.sandbox_id, pid, size.cols, size.rows)
        except DsecError as e:
            raise _process_error(e, pid) from None
        return pb.UpdateResponse()

    async def _stdin(self, t: Target, pid: str, data: bytes, close: bool = False) -> None:
        try:
            await t.edge.exec_stdin(t.sandbox_id, pid, data, close)
        except DsecError as e:
            raise _process_error(e, pid) from None


def _process_error(e: DsecError, pid: str) -> ConnectError:
    """An exec that has ended is "not found" to E2B (envd forgets ended processes)."""
    if e.status in (404, 409) and e.field == "exec_id":
        return ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found: {e.message}")
    return connect_error(e)


def _stdin_bytes(inp: pb.ProcessInput | None) -> bytes:
    match inp.input if inp is not None else None:
        case Oneof(field="stdin" | "pty", value=data):    # a PTY's input is typed into its terminal
            return bytes(data)
    return b""


def _process_info(info: ExecInfo) -> pb.ProcessInfo:
    """dsec runs the command line with the image's shell: cmd is that line, args are empty."""
    cfg = pb.ProcessConfig(cmd=info.cmd, args=[], envs=dict(info.env))
    if info.cwd:
        cfg.cwd = info.cwd
    out = pb.ProcessInfo(config=cfg, pid=int(info.exec_id))
    if info.tag:
        out.tag = info.tag
    return out


def process_app(ctx: ApiContext) -> ProcessASGIApplication:
    return ProcessASGIApplication(ProcessService(ctx))  # type: ignore[arg-type]
