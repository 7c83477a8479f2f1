"""Commands: run, stream, start detached, list, attach, follow, stdin, signal, sessions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from dsec.apiserver import control
from dsec.apiserver.deps import Ctx, ExecId, Who, owned
from dsec.types import (DsecError, ExecEvent, ExecInfo, ExecList, ExecRequest, ExecResult, ResizeRequest, SandboxInfo, SignalRequest,
                        TimeoutRequest)

router = APIRouter()


@router.post("/v1/sandboxes/{sandbox_id}/exec", response_model=ExecResult)
async def exec_(sandbox_id: str, req: ExecRequest, who: Who, ctx: Ctx) -> ExecResult:
    edge = await owned(ctx, sandbox_id, who)
    await control.check_exec(ctx, edge, sandbox_id, req)
    return await edge.run(sandbox_id, req)


def ndjson(first: ExecEvent, events: AsyncIterator[ExecEvent]) -> StreamingResponse:
    async def lines() -> AsyncIterator[bytes]:
        yield first.model_dump_json().encode() + b"\n"
        try:
            async for ev in events:
                # leave out the event's empty fields, never the result's (exit_code is null
                # when a signal killed the command)
                empty = {f for f in ("exec_id", "result") if getattr(ev, f) is None}
                yield ev.model_dump_json(exclude=empty).encode() + b"\n"
        except DsecError as e:
            yield ExecEvent(type="exit", data=e.message).model_dump_json().encode() + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


NDJSON = {200: {"content": {"application/x-ndjson": {}}, "description": "one ExecEvent JSON object per line"}}


@router.post("/v1/sandboxes/{sandbox_id}/exec/stream", responses=NDJSON)
async def exec_stream(sandbox_id: str, req: ExecRequest, who: Who, ctx: Ctx) -> StreamingResponse:
    edge = await owned(ctx, sandbox_id, who)
    await control.check_exec(ctx, edge, sandbox_id, req)
    events = edge.exec_stream(sandbox_id, req)
    first = await anext(events)   # errors before the first byte become proper HTTP errors
    return ndjson(first, events)


@router.post("/v1/sandboxes/{sandbox_id}/execs", status_code=201, response_model=ExecInfo)
async def exec_start(sandbox_id: str, req: ExecRequest, who: Who, ctx: Ctx) -> ExecInfo:
    """Start a command detached: its exec_id comes back at once. Follow its output with
    GET .../execs/{id}/stream (from the beginning, several followers at once), wait for its
    result with GET .../execs/{id}, write to its stdin (keep_stdin) or signal it."""
    edge = await owned(ctx, sandbox_id, who)
    await control.check_exec(ctx, edge, sandbox_id, req)
    return await edge.exec_start(sandbox_id, req)


@router.get("/v1/sandboxes/{sandbox_id}/execs", response_model=ExecList)
async def list_execs(sandbox_id: str, who: Who, ctx: Ctx) -> ExecList:
    """The sandbox's running commands."""
    edge = await owned(ctx, sandbox_id, who)
    return ExecList(execs=await edge.list_execs(sandbox_id))


@router.get("/v1/sandboxes/{sandbox_id}/execs/{exec_id}", response_model=ExecResult)
async def attach(sandbox_id: str, exec_id: ExecId, who: Who, ctx: Ctx) -> ExecResult:
    """Wait for an exec's result (also one started before a client or edge restart)."""
    edge = await owned(ctx, sandbox_id, who)
    return await edge.attach(sandbox_id, exec_id)


@router.get("/v1/sandboxes/{sandbox_id}/execs/{exec_id}/stream", responses=NDJSON)
async def exec_follow(sandbox_id: str, exec_id: ExecId, who: Who, ctx: Ctx) -> StreamingResponse:
    """An exec's output from its beginning, then live, then its exit (NDJSON ExecEvents)."""
    edge = await owned(ctx, sandbox_id, who)
    events = edge.exec_follow(sandbox_id, exec_id)
    first = await anext(events)
    return ndjson(first, events)


@router.post("/v1/sandboxes/{sandbox_id}/execs/{exec_id}/stdin", status_code=204)
async def exec_stdin(sandbox_id: str, exec_id: ExecId, request: Request, who: Who, ctx: Ctx,
                     close: bool = False) -> Response:
    """Write the request body to the stdin of a command started with keep_stdin; close=true
    then closes it (EOF)."""
    edge = await owned(ctx, sandbox_id, who)
    data = bytearray()
    async for chunk in request.stream():      # bounded by the guard (EXEC_BODY_BYTES)
        data += chunk
    await edge.exec_stdin(sandbox_id, exec_id, bytes(data), close)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/execs/{exec_id}/signal", status_code=204)
async def exec_signal(sandbox_id: str, exec_id: ExecId, req: SignalRequest, who: Who, ctx: Ctx) -> Response:
    """Send a signal to a running command's process group."""
    edge = await owned(ctx, sandbox_id, who)
    await edge.exec_signal(sandbox_id, exec_id, req.signal)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/execs/{exec_id}/resize", status_code=204)
async def exec_resize(sandbox_id: str, exec_id: ExecId, req: ResizeRequest, who: Who, ctx: Ctx) -> Response:
    """Resize the terminal of a command started with pty (its programs get SIGWINCH)."""
    edge = await owned(ctx, sandbox_id, who)
    await edge.exec_resize(sandbox_id, exec_id, req.cols, req.rows)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/timeout", response_model=SandboxInfo)
async def set_timeout(sandbox_id: str, req: TimeoutRequest, who: Who, ctx: Ctx) -> SandboxInfo:
    """The sandbox ends timeout_s from now, busy or not (its absolute lifetime)."""
    edge = await owned(ctx, sandbox_id, who)
    return await edge.set_timeout(sandbox_id, req.timeout_s)


@router.delete("/v1/sandboxes/{sandbox_id}/sessions/{name}", status_code=204)
async def close_session(sandbox_id: str, name: str, who: Who, ctx: Ctx) -> Response:
    edge = await owned(ctx, sandbox_id, who)
    await edge.close_session(sandbox_id, name)
    return Response(status_code=204)
