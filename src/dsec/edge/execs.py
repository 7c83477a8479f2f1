"""Commands: run, stream, start detached, follow, attach, stdin, signals, sessions.
"""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import AsyncIterator
from typing import Any

from dsec.agent import protocol as P
from dsec.agent.client import INTERNAL_CHAN_BASE, AgentClient, AgentDisconnected, AgentError, ExecLost
from dsec import metrics, tracing
from dsec.edge import output_budget
from dsec.edge.agent_errors import map_agent_error
from dsec.edge.exec_events import exec_events
from dsec.edge.exec_tracker import TrackedExec, now_utc
from dsec.edge.live import LiveSandbox
from dsec.security.users import resolve_user
from dsec.types import (EventType, Conflict, DsecError, ExecEvent, ExecInfo, ExecRequest, ExecResult, InvalidArgument, NotFound,
                        SandboxFailed, SandboxInfo, SandboxState)
from dsec.edge.core import EdgeCore


class Execs(EdgeCore):
    def _count_exec(self, sandbox_id: str, kind: str) -> str | None:
        """dsec_execs_total; the sandbox's backend (None: no such sandbox, the verb says so)."""
        live = self._live.get(sandbox_id)
        if live is None:
            return None
        metrics.EXECS.labels(live.rec.project, live.rec.backend, kind).inc()
        return live.rec.backend

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """start, stdout/stderr chunks as they arrive, then exit with the full ExecResult. With an
        idempotency key the edge follows the command itself: a retry follows the same one."""
        self._count_exec(sandbox_id, "stream")
        events = self._exec_stream(sandbox_id, req)
        if tracing.on():      # one span over the whole stream (docs/traces.md); no command text
            events = tracing.traced("dsec.edge.exec_stream", events, attrs={"dsec.sandbox_id": sandbox_id,
                                                                           "dsec.node": self.node_id}, note=_note_exit)
        async for ev in events:
            yield ev

    async def _exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        if req.idempotency_key is not None:
            tracked = await self._start_tracked(sandbox_id, req, detached=False)
            # exec_follow: the tracker, or the agent if the edge let go of it (a park, a restart)
            async for ev in self._exec_follow(sandbox_id, tracked.info.exec_id):
                yield ev
            return
        info = self._exec_info(req, detached=False)
        async for ev in self._exec_events(sandbox_id, req, info, tracked=False):
            yield ev

    @staticmethod
    def _exec_info(req: ExecRequest, detached: bool) -> ExecInfo:
        return ExecInfo(exec_id="", cmd=req.cmd, cwd=req.cwd, env=dict(req.env), tag=req.tag, session=req.session,
                        detached=detached, stdin_open=req.keep_stdin or req.pty is not None,
                        pty=req.pty is not None, started_at=now_utc())

    async def _exec_events(self, sandbox_id: str, req: ExecRequest, info: ExecInfo,
                           tracked: bool) -> AsyncIterator[ExecEvent]:
        async with self._use(sandbox_id) as (live, agent):
            rec = live.rec
            chan = live.take_chan()
            uid, gid = resolve_user(req.user) if req.user else (rec.uid, rec.gid)
            cap = req.output_cap_bytes or rec.args.output_cap_bytes
            # the sandbox's lifetime output budget (output_budget.py) may shrink this cap
            grant = output_budget.reserve(rec, cap)
            delivered = 0                # once started: all, unless the exit result says less
            env = {**rec.args.env, **req.env}
            pty = (req.pty.cols, req.pty.rows) if req.pty is not None else None
            if pty is not None and agent.protocol_version < P.PTY_VERSION:
                raise Conflict(f"sandbox {rec.id} was started before dsec had PTYs: its agent speaks protocol "
                               f"{agent.protocol_version}, a PTY needs {P.PTY_VERSION}", field="pty",
                               fix="create a new sandbox for PTYs, or run the command without pty")
            agent_span: Any = None
            try:
                # bounded per sandbox (count and output reserved): 429 + Retry-After beyond
                with live.exec_slot(grant.reserved):
                    # the agent round trip: the exec sent to the agent until its exit came back
                    agent_span = tracing.open_span("dsec.agent.exec", attrs={"dsec.sandbox_id": rec.id}) \
                        if tracing.on() else None
                    try:   # sent before "start" is announced: a restarted edge can then attach to it
                        events = await agent.start_exec(
                            chan, cmd=req.cmd, uid=uid, gid=gid, cwd=req.cwd, env=env,
                            timeout_ms=int(req.timeout_s * 1000), cap=grant.per_stream, session=req.session,
                            stdin=req.stdin.encode() if req.stdin is not None else None,
                            keep_stdin=req.keep_stdin, pty=pty)
                    except AgentError as e:
                        raise map_agent_error(e, "cmd") from e
                    delivered = grant.reserved
                    info.exec_id = str(chan)
                    if not tracked:     # listed (list_execs) while it runs; tracked ones are kept apart
                        live.commands.running[info.exec_id] = info
                    yield ExecEvent(type="start", exec_id=str(chan))
                    try:
                        async for ev in exec_events(str(chan), events, time.monotonic(), pty=pty is not None):
                            if ev.type == "exit" and ev.result is not None:
                                r = ev.result
                                delivered = min(r.stdout_bytes, grant.per_stream) + min(r.stderr_bytes, grant.per_stream)
                                r.output_budget_exhausted = grant.exhausted and (r.truncated or grant.per_stream == 0)
                                tracing.close_span(agent_span, {"dsec.exit_code": r.exit_code})
                                agent_span = None
                                # the result is in hand: the agent frees its copy now, before the
                                # exit event (run() and other callers stop iterating there)
                                try:
                                    await agent.release(chan)
                                except AgentDisconnected:
                                    pass          # gone with the connection; the agent's -R bounds it
                            yield ev
                    except AgentError as e:   # could not start (EAGAIN at pids_limit, EBUSY session ...)
                        delivered = 0
                        raise map_agent_error(e, "session" if e.errno == 16 else "cmd") from e
                    except ExecLost as e:
                        raise SandboxFailed(f"exec {chan} in sandbox {rec.id} ended without a result: {e}",
                                            field="exec_id", fix="run the command again") from e
            finally:
                tracing.close_span(agent_span)      # ended without an exit (an error, the caller gone)
                live.commands.running.pop(info.exec_id, None)
                output_budget.settle(rec, grant, delivered)
                self._dirty.add(rec.id)

    async def run(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        backend = self._count_exec(sandbox_id, "run")
        t0 = time.monotonic()
        if tracing.on():      # no command text on the span (docs/traces.md)
            with tracing.span("dsec.edge.exec", attrs={"dsec.sandbox_id": sandbox_id, "dsec.node": self.node_id}) as s:
                result = await self._run(sandbox_id, req)
                tracing.set_attrs(s, {"dsec.exit_code": result.exit_code})
        else:
            result = await self._run(sandbox_id, req)
        if backend is not None:
            metrics.EXEC_SECONDS.labels(backend).observe(time.monotonic() - t0)
        return result

    async def _run(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        if req.idempotency_key is not None:
            # the tracker's own error (a missing cwd, a busy session ...) as it was raised, not
            # the exit event's text: a keyed run answers as an unkeyed one does
            tracked = await self._start_tracked(sandbox_id, req, detached=False)
            try:
                return await tracked.wait_result()
            except DsecError as e:
                if e is tracked.error:
                    raise
                raise SandboxFailed(f"the command ended without a result: {e}", field="cmd",   # let go of (a park)
                                    fix="run it again") from None
        async for ev in self._exec_stream(sandbox_id, req):
            if ev.type == "exit":
                if ev.result is None:     # a followed (idempotent) exec that was lost
                    raise SandboxFailed(f"the command ended without a result: {ev.data}", field="cmd",
                                        fix="run it again")
                return ev.result
        raise SandboxFailed("exec ended without an exit status")

    async def _start_tracked(self, sandbox_id: str, req: ExecRequest, detached: bool) -> TrackedExec:
        """Start a command the edge follows itself (or find the one an earlier request with the
        same idempotency key started); returns once it runs (errors starting it are raised)."""
        live = await self._live_resumed(sandbox_id)
        key = req.idempotency_key
        tracked = live.commands.by_key.get(key) if key is not None else None
        if tracked is None:
            info = self._exec_info(req, detached)
            tracked = live.commands.start_tracking(
                info, key, lambda t: self._exec_events(sandbox_id, req, t.info, tracked=True))
        await tracked.started.wait()
        if not tracked.info.exec_id:
            raise tracked.error or SandboxFailed("the command did not start", field="cmd", fix="run it again")
        return tracked      # reachable by its exec id since it started (ExecTable), unless let go of

    async def exec_start(self, sandbox_id: str, req: ExecRequest) -> ExecInfo:
        """Start a command detached: returns its exec id at once; follow it with exec_follow,
        feed it with exec_stdin, signal it, or wait for its result with attach."""
        self._count_exec(sandbox_id, "start")
        tracked = await self._start_tracked(sandbox_id, req, detached=True)
        return tracked.info.model_copy()

    def _exec_chan(self, sandbox_id: str, exec_id: str) -> int:
        try:
            chan = int(exec_id)
        except ValueError:
            raise InvalidArgument(f"bad exec id {exec_id!r}", field="exec_id", fix="use the exec_id from run/stream") from None
        if not 0 < chan < INTERNAL_CHAN_BASE:    # never the chan of an exec (0, negative, internal)
            raise NotFound(f"no exec {exec_id} in sandbox {sandbox_id}", field="exec_id",
                           fix="use the exec_id from run/stream")
        return chan

    async def exec_follow(self, sandbox_id: str, exec_id: str) -> AsyncIterator[ExecEvent]:
        """start, all output of the exec from its beginning, then live, then exit. Several
        followers at once for execs the edge tracks (start_exec, idempotency key); others (after
        an edge restart, or a plain exec whose stream was lost) are attached at the agent, which
        replays what it retained."""
        events = self._exec_follow(sandbox_id, exec_id)
        if tracing.on():      # one span over the whole follow (docs/traces.md)
            events = tracing.traced("dsec.edge.exec_follow", events, attrs={"dsec.sandbox_id": sandbox_id,
                                                                           "dsec.node": self.node_id,
                                                                           "dsec.exec_id": exec_id}, note=_note_exit)
        async for ev in events:
            yield ev

    async def _exec_follow(self, sandbox_id: str, exec_id: str) -> AsyncIterator[ExecEvent]:
        chan = self._exec_chan(sandbox_id, exec_id)
        live = await self._live_resumed(sandbox_id)
        tracked = live.commands.tracked.get(exec_id)
        if tracked is not None:
            async for ev in tracked.follow():
                yield ev
            return
        async with self._use(sandbox_id) as (_, agent):
            yield ExecEvent(type="start", exec_id=exec_id)
            agent_span = tracing.open_span("dsec.agent.attach", attrs={"dsec.sandbox_id": sandbox_id}) \
                if tracing.on() else None
            try:
                async for ev in exec_events(exec_id, agent.attach(chan), time.monotonic()):
                    if ev.type == "exit":
                        tracing.close_span(agent_span, {"dsec.exit_code": ev.result.exit_code if ev.result else None})
                        agent_span = None
                        await agent.release(chan)
                    yield ev
            except AgentError as e:
                raise map_agent_error(e, "exec_id") from e
            except ValueError as e:   # the agent connection follows this chan already (AgentClient._register)
                raise Conflict(f"exec {chan} is being followed already, by another attach or the stream that "
                               "started it", field="exec_id",
                               fix="wait for that request to return the result, then attach again") from e
            finally:
                tracing.close_span(agent_span)

    async def attach(self, sandbox_id: str, exec_id: str) -> ExecResult:
        """Result of an earlier exec (waits for it; also after the client or the edge restarted)."""
        if tracing.on():
            with tracing.span("dsec.edge.attach", attrs={"dsec.sandbox_id": sandbox_id, "dsec.node": self.node_id,
                                                        "dsec.exec_id": exec_id}) as s:
                result = await self._attach(sandbox_id, exec_id)
                tracing.set_attrs(s, {"dsec.exit_code": result.exit_code})
                return result
        return await self._attach(sandbox_id, exec_id)

    async def _attach(self, sandbox_id: str, exec_id: str) -> ExecResult:
        async for ev in self._exec_follow(sandbox_id, exec_id):
            if ev.type == "exit":
                if ev.result is None:
                    raise SandboxFailed(f"exec {exec_id} ended without a result: {ev.data}", field="exec_id",
                                        fix="run the command again")
                return ev.result
        raise SandboxFailed("attach ended without an exit status")

    def _known_exec(self, live: LiveSandbox, exec_id: str) -> ExecInfo | None:
        tracked = live.commands.tracked.get(exec_id)
        return tracked.info if tracked is not None else live.commands.running.get(exec_id)

    async def _check_running_exec(self, live: LiveSandbox, agent: AgentClient, chan: int) -> ExecInfo | None:
        info = self._known_exec(live, str(chan))
        if info is not None and not info.running:
            raise Conflict(f"exec {chan} has ended", field="exec_id", fix="start a new command")
        if info is None and chan not in {c for c, done in await agent.list_execs() if not done}:
            raise NotFound(f"no running exec {chan} in sandbox {live.id}", field="exec_id",
                           fix="list running commands with list_execs")
        return info

    async def exec_stdin(self, sandbox_id: str, exec_id: str, data: bytes, close: bool = False) -> None:
        """Write to the stdin of a command started with keep_stdin; close=True closes it (EOF)
        after `data`."""
        chan = self._exec_chan(sandbox_id, exec_id)
        async with self._use(sandbox_id) as (live, agent):
            info = await self._check_running_exec(live, agent, chan)
            if info is not None and not info.stdin_open:
                raise Conflict(f"exec {chan}'s stdin is not open: it was started without keep_stdin, or closed",
                               field="exec_id", fix="start the command with keep_stdin=true to write to it later")
            if data:
                await agent.send_stdin(chan, data)
            if close:
                await agent.send_stdin(chan, b"")
                if info is not None:
                    info.stdin_open = False

    async def exec_resize(self, sandbox_id: str, exec_id: str, cols: int, rows: int) -> None:
        """New size of a PTY exec's terminal (its programs get SIGWINCH)."""
        if not (0 < cols <= 4096 and 0 < rows <= 4096):
            raise InvalidArgument(f"terminal size {cols}x{rows} is out of range", field="cols",
                                  fix="use 1..4096 columns and rows")
        chan = self._exec_chan(sandbox_id, exec_id)
        async with self._use(sandbox_id) as (live, agent):
            info = await self._check_running_exec(live, agent, chan)
            if info is not None and not info.pty:
                raise Conflict(f"exec {chan} does not run on a terminal", field="exec_id",
                               fix="start the command with pty to resize its terminal")
            await agent.resize(chan, cols, rows)

    async def exec_signal(self, sandbox_id: str, exec_id: str, signal: int) -> None:
        """Send `signal` to a running command (its whole process group)."""
        if not 0 < signal <= 64:
            raise InvalidArgument(f"signal {signal} is not a signal number", field="signal", fix="use 1..64, e.g. 15")
        chan = self._exec_chan(sandbox_id, exec_id)
        async with self._use(sandbox_id) as (live, agent):
            await self._check_running_exec(live, agent, chan)
            await agent.signal(chan, signal)

    async def list_execs(self, sandbox_id: str) -> builtins.list[ExecInfo]:
        """The sandbox's running commands (the agent's list, with what the edge knows of each)."""
        async with self._use(sandbox_id) as (live, agent):
            running = sorted(c for c, done in await agent.list_execs() if not done and 0 < c < INTERNAL_CHAN_BASE)
            out = []
            for chan in running:
                info = self._known_exec(live, str(chan))
                out.append(info.model_copy() if info is not None else ExecInfo(exec_id=str(chan)))
            return out

    async def set_timeout(self, sandbox_id: str, timeout_s: float) -> SandboxInfo:
        """The sandbox ends `timeout_s` from now, busy or not (its absolute lifetime)."""
        rec = self._record(sandbox_id)
        if rec.state not in (SandboxState.running, SandboxState.suspended, SandboxState.creating):
            raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}", field="sandbox_id", fix="create a new sandbox",
                           reason=rec.end_reason)
        rec.expires_at = time.time() + timeout_s
        await asyncio.to_thread(self.records.set_expires_at, rec.id, rec.expires_at)
        self._emit(EventType.updated, rec, set_timeout=rec.expires_at)
        self._schedule(rec)
        return rec.info(self.node_id)

    async def close_session(self, sandbox_id: str, name: str) -> None:
        async with self._use(sandbox_id) as (_, agent):
            await agent.close_session(name)


def _note_exit(span: Any, ev: ExecEvent) -> None:
    """The exit code on a stream's span (traced()), once the exit event passes."""
    if ev.type == "exit" and ev.result is not None:
        tracing.set_attrs(span, {"dsec.exit_code": ev.result.exit_code})
