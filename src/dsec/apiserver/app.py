"""The apiserver: the one ingress between trusted callers and untrusted sandboxes.

It keeps no per-sandbox state. A sandbox id names its node, so every request after creation is
forwarded straight to that node's edge; creation asks placement for a node.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsec.apiserver import control, listing
from dsec.apiserver.index import keeper
from dsec.apiserver.context import ApiContext, EdgeHandle
from dsec.apiserver.tenancy import visible
from dsec.apiserver.guard import (MAX_FILE_BYTES, QUERY_KEY_PATHS, BodyTooLarge, RequestGuard, principal_of,
                                  request_key)
from dsec.iam import Principal
from dsec.iam.policy import EffectivePolicy, SandboxPolicy, check_create, check_network
from dsec.types import (CapacityExceeded, ContainerArgs, DsecError, Forbidden, ExecEvent, ExecRequest, ExecResult,
                        FileList, ImageList, InvalidArgument, NetworkPolicy, NodeStatus, NotFound,
                        SandboxInfo, SandboxList, Unavailable)
from dsec.types import ErrorBody, InternalError
from dsec.types import FnCallRequest
from dsec.types import ImageInfo, PackDiffRequest
from dsec.types import MicroVMArgs, SandboxArgs, SnapshotInfo, SnapshotList, VMArgs, node_of_snapshot
from dsec.types import BulkResult, BulkSelector, ExecInfo, ExecList, SignalRequest, TimeoutRequest

log = logging.getLogger("dsec.apiserver")

BACKEND_TAGS = {"container": ContainerArgs, "microvm": MicroVMArgs, "vm": VMArgs}


def _fields_for(path: str, loc: tuple) -> list[str]:
    """Allowed fields of the model a request was validated against (for the error's fix)."""
    if path.startswith("/v1/fncall"):
        return list(FnCallRequest.model_fields)
    tag = next((str(p) for p in loc if str(p) in BACKEND_TAGS), "container")
    return list(BACKEND_TAGS[tag].model_fields)


PLACEMENT_TRIES = 3


def _principal(request: Request) -> Principal:
    """Who the guard authenticated (`Authorization: Bearer <key>`), before the body was read."""
    return principal_of(request) or request.app.state.ctx.iam.authenticate(request_key(request))


# Module level: FastAPI resolves these (string) annotations in the module's globals.
Who = Annotated[Principal, Depends(_principal)]
Path_ = Annotated[str, Query(min_length=1, max_length=4096, description="path inside the sandbox")]
ExecId = Annotated[str, PathParam(pattern=r"^[0-9]{1,10}$", description="the exec_id from run/stream")]

# Documented on every route that needs a key: all answer errors as ErrorBody.
ERROR_RESPONSES = {
    400: "malformed request: the body is not UTF-8 JSON, is nested too deeply, or has a bad Content-Length",
    401: "no API key, or an unknown or revoked one",
    403: "the project's sandbox policy does not allow it",
    404: "no such sandbox, exec, snapshot, project or path (those of other projects look missing too)",
    409: "the target's state does not allow it: sandbox stopped, session busy, exec already attached",
    413: "the request body is larger than the route accepts",
    422: "an argument is invalid: `field` names it, `fix` says what to send",
    429: "no capacity for it on any node, or the project's quota is spent",
    500: "a sandbox failed, or a bug in dsec (the server log has the details)",
    503: "the service is not available now (no healthy node, shutting down); retry later",
}


def _short(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + f"... ({len(text)} chars)"


def _http_error(request: Request, e: StarletteHTTPException) -> DsecError:
    """Starlette's and FastAPI's own HTTP errors (no route, wrong method, unparsable body) as
    dsec errors."""
    if isinstance(e, BodyTooLarge):
        return e.error
    if e.status_code == 404:
        return NotFound(f"no route {request.method} {_short(request.url.path)}", field="path",
                        fix="see the routes at /openapi.json")
    if e.status_code == 400:
        cause = e.__cause__
        msg = ("request body is not valid UTF-8" if isinstance(cause, UnicodeDecodeError) else
               "request body JSON is nested too deeply" if isinstance(cause, RecursionError) else
               f"request body could not be parsed: {e.detail}")
        return DsecError(msg, field="body", fix="send UTF-8 JSON as described at /openapi.json "
                                                "(nested at most a few levels deep)")
    err = DsecError(str(e.detail), fix="see /openapi.json")
    err.status = e.status_code
    err.code = "method_not_allowed" if e.status_code == 405 else f"http_{e.status_code}"
    return err


def _add_openapi(app: FastAPI, public_paths: frozenset[str]) -> None:
    """The schema says what the server does: a bearer key on every route but the public ones
    (FnCall routes also take ?api_key=), and the real error body for every error status."""
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {})
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "an API key, dsk_... (the admin key is in $DSEC_HOME/admin.key)"},
            "api_key_query": {"type": "apiKey", "in": "query", "name": "api_key",
                              "description": "the API key in the URL: FnCall routes only (SandboxFusion clients)"},
        }
        models = components.setdefault("schemas", {})
        error_schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        models.update(error_schema.pop("$defs", {}))
        models["ErrorBody"] = error_schema
        error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
        for path, operations in schema.get("paths", {}).items():
            for op in operations.values():
                if path in public_paths:
                    op["security"] = []
                    continue
                op["security"] = [{"bearer": []}] + ([{"api_key_query": []}] if QUERY_KEY_PATHS.match(path) else [])
                responses = op.setdefault("responses", {})
                for status, description in ERROR_RESPONSES.items():
                    responses[str(status)] = {"description": description, "content": error_ref}
                op["responses"] = dict(sorted(responses.items()))
        for unused in ("HTTPValidationError", "ValidationError"):   # FastAPI's 422 body, never sent
            models.pop(unused, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(ctx: ApiContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await keeper(ctx).stop()     # the sandbox index's queued writes (apiserver/index.py)

    app = FastAPI(title="dsec", version="0.1.0", lifespan=lifespan,
                  description="Elastic sandboxes for agent training and evaluation")
    app.state.ctx = ctx
    public = frozenset(p for p in ("/healthz", app.openapi_url, app.docs_url, app.redoc_url,
                                   app.swagger_ui_oauth2_redirect_url) if p)
    # authenticate from the headers, then bound the body per route (guard.py)
    app.add_middleware(RequestGuard, authenticate=ctx.iam.authenticate, public_paths=public)
    _add_openapi(app, public)

    # -- errors: always JSON {"error": {code, message, field, fix}} ------------------------
    @app.exception_handler(DsecError)
    async def _dsec_error(_: Request, e: DsecError) -> JSONResponse:
        # a refusal that passes (a sandbox's exec slots, edge/live.py) says when to retry
        retry = getattr(e, "retry_after_s", None)
        headers = {"Retry-After": str(retry)} if isinstance(e, CapacityExceeded) and retry else None
        return JSONResponse(e.to_body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = _http_error(request, e)
        return JSONResponse(err.to_body(), status_code=err.status, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        # the backstop behind RequestGuard's own: never a plain-text 500
        log.error("unhandled error", exc_info=e, extra={"method": request.method, "path": request.url.path})
        err = InternalError(f"internal error ({type(e).__name__})", fix="retry; if it persists, report it "
                                                                       "with the server log")
        return JSONResponse(err.to_body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        # drop the transport part and the backend tag of the args union from the field path
        loc = [_short(str(p), 64) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
        if request.url.path == "/v1/sandboxes" and loc and loc[0] in BACKEND_TAGS:
            loc = loc[1:]
        fieldname = ".".join(loc) or "body"
        msg = _short(first.get("msg", "invalid request"), 1000)
        if first.get("type") == "json_invalid":
            fieldname, msg = "body", "request body is not valid JSON"
        err = InvalidArgument(f"{fieldname}: {msg}", field=fieldname,
                              fix="see the schema at /openapi.json" + (
                                  "; allowed fields: " + ", ".join(
                                      _fields_for(request.url.path, first.get("loc", ())))
                                  if first.get("type") == "extra_forbidden" else ""))
        return JSONResponse(err.to_body(), status_code=err.status)

    async def owned(sandbox_id: str, who: Principal) -> EdgeHandle:
        return await control.owned_edge(ctx, sandbox_id, who)

    async def owned_snapshot(snapshot_id: str, who: Principal, field: str = "snapshot_id") -> EdgeHandle:
        """The edge holding a snapshot the caller's project (or an ancestor) took."""
        node = node_of_snapshot(snapshot_id)
        edge = ctx.edges.get(node)
        missing = NotFound(f"no snapshot {snapshot_id!r}", field=field,
                           fix="use an id returned by Sandbox.snapshot(); list them with `dsec vm snapshot ls`")
        if edge is None:
            raise missing
        try:
            info = await edge.get_snapshot(snapshot_id)
        except NotFound:
            raise missing from None
        if not ctx.iam.can_access(who, info.project):
            raise missing          # a snapshot holds a guest's memory: other projects never reach it
        return edge

    # -- routes --------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "nodes": len(ctx.edges)}

    @app.post("/v1/sandboxes", status_code=201, response_model=SandboxInfo)
    async def create_sandbox(args: Annotated[SandboxArgs, Body()], who: Who) -> SandboxInfo:
        """Create a sandbox; `backend` picks the argument type: container (default), microvm, vm."""
        # what a sandbox may loosen is bounded by its project's policy (iam/policy.py),
        # other projects' layers look missing (control.create_sandbox)
        if getattr(args, "snapshot", None):
            # a snapshot lives on one node: the new sandbox is restored there
            check_create(ctx.iam.effective_policy(who.project_id), args, who.project_id)
            edge = await owned_snapshot(args.snapshot, who, field="snapshot")
            return await control.create_on(ctx, edge, who, args)
        return await control.create_sandbox(ctx, who, args)

    @app.get("/v1/sandboxes", response_model=SandboxList)
    async def list_sandboxes(who: Who, include_ended: bool = False) -> SandboxList:
        """The caller's sandboxes on every node; a node that does not answer within seconds is
        named in `unreachable_nodes` and its sandboxes listed as last indexed (listing.py)."""
        return await listing.list_sandboxes(ctx, who, include_ended)

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def get_sandbox(sandbox_id: str, who: Who) -> SandboxInfo:
        edge = await owned(sandbox_id, who)
        return await edge.get(sandbox_id, usage=True)

    @app.delete("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def stop_sandbox(sandbox_id: str, who: Who) -> SandboxInfo:
        edge = await owned(sandbox_id, who)
        return await control.stop_sandbox(ctx, edge, sandbox_id)

    @app.put("/v1/sandboxes/{sandbox_id}/network", response_model=SandboxInfo)
    async def set_network(sandbox_id: str, policy: NetworkPolicy, who: Who) -> SandboxInfo:
        """Replace the egress policy of a running sandbox (effective for new connections at once)."""
        edge = await owned(sandbox_id, who)
        project = (await edge.get(sandbox_id)).project    # the sandbox's project's policy applies
        check_network(ctx.iam.effective_policy(project), policy, project, prefix="")
        return await edge.set_network(sandbox_id, policy)

    async def check_exec(edge: EdgeHandle, sandbox_id: str, req: ExecRequest) -> None:
        await control.check_exec(ctx, edge, sandbox_id, req)

    @app.get("/v1/projects/{project_id}/policy", response_model=EffectivePolicy)
    async def get_policy(project_id: str, who: Who) -> EffectivePolicy:
        """A project's own sandbox policy and the effective one (narrowed by its ancestors)."""
        if not ctx.iam.can_access(who, project_id):
            raise NotFound(f"no project {project_id!r}", field="project_id", fix="check the id and API key")
        return EffectivePolicy(project_id=project_id, own=ctx.iam.own_policy(project_id),
                               effective=ctx.iam.effective_policy(project_id))

    @app.put("/v1/projects/{project_id}/policy", response_model=EffectivePolicy)
    async def set_policy(project_id: str, policy: SandboxPolicy, who: Who) -> EffectivePolicy:
        """Replace a project's own sandbox policy (from a key of a parent project; it may only
        narrow the parent's). Applies to new sandboxes and later set_network calls."""
        if not ctx.iam.can_access(who, project_id):
            raise NotFound(f"no project {project_id!r}", field="project_id", fix="check the id and API key")
        ctx.iam.set_policy(project_id, policy, by=who)
        return EffectivePolicy(project_id=project_id, own=ctx.iam.own_policy(project_id),
                               effective=ctx.iam.effective_policy(project_id))

    @app.get("/v1/sandboxes/{sandbox_id}/console", response_class=Response)
    async def console(sandbox_id: str, who: Who,
                      tail: Annotated[int, Query(ge=1, le=1 << 20)] = 65536) -> Response:
        """VM sandboxes: the last `tail` bytes of the guest's serial console (kernel messages,
        init errors), also after the VM failed."""
        edge = await owned(sandbox_id, who)
        return Response(await edge.console(sandbox_id, tail), media_type="text/plain; charset=utf-8")

    # before /v1/sandboxes/{sandbox_id}/...: "bulk" is not a sandbox id
    async def bulk(sel: BulkSelector, who: Principal, verb: str) -> BulkResult:
        """The caller's sandboxes with all of sel.labels, on every node, through each edge's bulk
        verb; those of a node that does not answer come back with an error naming it."""
        return await listing.bulk(ctx, who, dict(sel.labels), verb)

    @app.post("/v1/sandboxes/bulk/suspend", response_model=BulkResult)
    async def suspend_many(sel: BulkSelector, who: Who) -> BulkResult:
        """Park every one of the caller's sandboxes that has all these labels (e.g. a trainer's
        job, on preemption); each one's outcome. Parked ones resume on their next request."""
        return await bulk(sel, who, "suspend_many")

    @app.post("/v1/sandboxes/bulk/resume", response_model=BulkResult)
    async def resume_many(sel: BulkSelector, who: Who) -> BulkResult:
        return await bulk(sel, who, "resume_many")

    @app.post("/v1/sandboxes/{sandbox_id}/suspend", response_model=SandboxInfo)
    async def suspend(sandbox_id: str, who: Who) -> SandboxInfo:
        """Park the sandbox (a VM saved to disk, a container frozen with its memory pushed to
        compressed swap); the next request to it resumes it."""
        edge = await owned(sandbox_id, who)
        return await edge.suspend(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo)
    async def resume(sandbox_id: str, who: Who) -> SandboxInfo:
        edge = await owned(sandbox_id, who)
        return await edge.resume(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot", status_code=201, response_model=SnapshotInfo)
    async def snapshot(sandbox_id: str, who: Who) -> SnapshotInfo:
        """Save a running VM (memory, devices, disk); restore it as new sandboxes with
        `{"backend": ..., "image": ..., "snapshot": id}`. The VM pauses briefly and runs on."""
        edge = await owned(sandbox_id, who)
        return await edge.snapshot(sandbox_id)

    @app.get("/v1/snapshots", response_model=SnapshotList)
    async def list_snapshots(who: Who) -> SnapshotList:
        """VM snapshots of the caller's project and its sub-projects, on every node."""
        out: list[SnapshotInfo] = []
        for edge in ctx.edges.values():
            out += [s for s in await edge.list_snapshots() if ctx.iam.can_access(who, s.project)]
        return SnapshotList(snapshots=out)

    @app.get("/v1/snapshots/{snapshot_id}", response_model=SnapshotInfo)
    async def get_snapshot(snapshot_id: str, who: Who) -> SnapshotInfo:
        edge = await owned_snapshot(snapshot_id, who)
        return await edge.get_snapshot(snapshot_id)

    @app.delete("/v1/snapshots/{snapshot_id}", status_code=204)
    async def delete_snapshot(snapshot_id: str, who: Who) -> Response:
        """Free a snapshot's disk. Sandboxes restored from it, and snapshots of those, are not
        affected (they keep their own links to the disk it shares with them)."""
        edge = await owned_snapshot(snapshot_id, who)
        await edge.delete_snapshot(snapshot_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/pack_diff", status_code=201, response_model=ImageInfo)
    async def pack_diff(sandbox_id: str, req: PackDiffRequest, who: Who) -> ImageInfo:
        """Snapshot the sandbox's writable changes as a new workspace layer NAME@VERSION."""
        edge = await owned(sandbox_id, who)
        return await edge.pack_diff(sandbox_id, req)

    @app.post("/v1/sandboxes/{sandbox_id}/exec", response_model=ExecResult)
    async def exec_(sandbox_id: str, req: ExecRequest, who: Who) -> ExecResult:
        edge = await owned(sandbox_id, who)
        await check_exec(edge, sandbox_id, req)
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

    @app.post("/v1/sandboxes/{sandbox_id}/exec/stream", responses=NDJSON)
    async def exec_stream(sandbox_id: str, req: ExecRequest, who: Who) -> StreamingResponse:
        edge = await owned(sandbox_id, who)
        await check_exec(edge, sandbox_id, req)
        events = edge.exec_stream(sandbox_id, req)
        first = await anext(events)   # errors before the first byte become proper HTTP errors
        return ndjson(first, events)

    @app.post("/v1/sandboxes/{sandbox_id}/execs", status_code=201, response_model=ExecInfo)
    async def exec_start(sandbox_id: str, req: ExecRequest, who: Who) -> ExecInfo:
        """Start a command detached: its exec_id comes back at once. Follow its output with
        GET .../execs/{id}/stream (from the beginning, several followers at once), wait for its
        result with GET .../execs/{id}, write to its stdin (keep_stdin) or signal it."""
        edge = await owned(sandbox_id, who)
        await check_exec(edge, sandbox_id, req)
        return await edge.exec_start(sandbox_id, req)

    @app.get("/v1/sandboxes/{sandbox_id}/execs", response_model=ExecList)
    async def list_execs(sandbox_id: str, who: Who) -> ExecList:
        """The sandbox's running commands."""
        edge = await owned(sandbox_id, who)
        return ExecList(execs=await edge.list_execs(sandbox_id))

    @app.get("/v1/sandboxes/{sandbox_id}/execs/{exec_id}", response_model=ExecResult)
    async def attach(sandbox_id: str, exec_id: ExecId, who: Who) -> ExecResult:
        """Wait for an exec's result (also one started before a client or edge restart)."""
        edge = await owned(sandbox_id, who)
        return await edge.attach(sandbox_id, exec_id)

    @app.get("/v1/sandboxes/{sandbox_id}/execs/{exec_id}/stream", responses=NDJSON)
    async def exec_follow(sandbox_id: str, exec_id: ExecId, who: Who) -> StreamingResponse:
        """An exec's output from its beginning, then live, then its exit (NDJSON ExecEvents)."""
        edge = await owned(sandbox_id, who)
        events = edge.exec_follow(sandbox_id, exec_id)
        first = await anext(events)
        return ndjson(first, events)

    @app.post("/v1/sandboxes/{sandbox_id}/execs/{exec_id}/stdin", status_code=204)
    async def exec_stdin(sandbox_id: str, exec_id: ExecId, request: Request, who: Who,
                         close: bool = False) -> Response:
        """Write the request body to the stdin of a command started with keep_stdin; close=true
        then closes it (EOF)."""
        edge = await owned(sandbox_id, who)
        data = bytearray()
        async for chunk in request.stream():      # bounded by the guard (EXEC_BODY_BYTES)
            data += chunk
        await edge.exec_stdin(sandbox_id, exec_id, bytes(data), close)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/execs/{exec_id}/signal", status_code=204)
    async def exec_signal(sandbox_id: str, exec_id: ExecId, req: SignalRequest, who: Who) -> Response:
        """Send a signal to a running command's process group."""
        edge = await owned(sandbox_id, who)
        await edge.exec_signal(sandbox_id, exec_id, req.signal)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/timeout", response_model=SandboxInfo)
    async def set_timeout(sandbox_id: str, req: TimeoutRequest, who: Who) -> SandboxInfo:
        """The sandbox ends timeout_s from now, busy or not (its absolute lifetime)."""
        edge = await owned(sandbox_id, who)
        return await edge.set_timeout(sandbox_id, req.timeout_s)

    @app.delete("/v1/sandboxes/{sandbox_id}/sessions/{name}", status_code=204)
    async def close_session(sandbox_id: str, name: str, who: Who) -> Response:
        edge = await owned(sandbox_id, who)
        await edge.close_session(sandbox_id, name)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files", response_class=Response,
             responses={200: {"content": {"application/octet-stream": {}}}})
    async def read_file(sandbox_id: str, path: Path_, who: Who) -> Response:
        edge = await owned(sandbox_id, who)
        return Response(await edge.read_file(sandbox_id, path, MAX_FILE_BYTES), media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def write_file(sandbox_id: str, path: Path_, request: Request, who: Who,
                         mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644, mkdirs: bool = True) -> Response:
        edge = await owned(sandbox_id, who)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FILE_BYTES:
                raise InvalidArgument(f"file larger than {MAX_FILE_BYTES} bytes", field="body",
                                      fix="split the file, or write it from inside the sandbox")
        await edge.write_file(sandbox_id, path, bytes(body), mode, mkdirs)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list", response_model=FileList)
    async def list_files(sandbox_id: str, path: Path_, who: Who) -> FileList:
        edge = await owned(sandbox_id, who)
        return FileList(path=path, entries=await edge.list_dir(sandbox_id, path))

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def remove_file(sandbox_id: str, path: Path_, who: Who) -> Response:
        edge = await owned(sandbox_id, who)
        await edge.remove_file(sandbox_id, path)
        return Response(status_code=204)

    WATCH_NDJSON = {200: {"content": {"application/x-ndjson": {}},
                          "description": "one FsEvent JSON object per line; an error ends it with a line "
                                         "{\"error\": {code, message, field, fix}}"}}

    @app.get("/v1/sandboxes/{sandbox_id}/files/watch", responses=WATCH_NDJSON)
    async def watch_files(sandbox_id: str, path: Path_, who: Who, recursive: bool = False) -> StreamingResponse:
        """Changes below directory `path` as they happen (its whole tree with recursive=true), as
        the sandbox's user: `start` once the watch is in place, then create, write, remove,
        rename, chmod (name relative to `path`), `overflow` when events were lost; until the
        client goes away. The sandbox counts as busy meanwhile."""
        edge = await owned(sandbox_id, who)
        events = edge.watch_dir(sandbox_id, path, recursive)
        first = await anext(events)   # refusals (missing, not allowed, too many) are HTTP errors

        async def lines() -> AsyncIterator[bytes]:
            yield first.model_dump_json().encode() + b"\n"
            try:
                async for ev in events:
                    yield ev.model_dump_json().encode() + b"\n"
            except DsecError as e:
                yield json.dumps(e.to_body()).encode() + b"\n"
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:    # does not suspend: a client gone away frees the watch
                    await aclose()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    from dsec.apiserver.fncall_routes import add_fncall_routes
    add_fncall_routes(app, ctx)   # /v1/fncall, /v1/fncall/batch, SandboxFusion-compatible /run_code
    from dsec.apiserver.ports import add_port_routes
    add_port_routes(app, ctx)     # /v1/sandboxes/{id}/ports/{port}/...: HTTP and WebSocket into a sandbox
    from dsec.apiserver.e2b import add_e2b_routes
    add_e2b_routes(app, ctx)      # E2B's REST API and envd, for the stock e2b SDK
    from dsec.apiserver.iam_routes import add_iam_routes
    add_iam_routes(app, ctx)      # /v1/projects (nested, quotas) and /v1/keys
    from dsec.apiserver.warm_pool_routes import add_warm_pool_routes
    add_warm_pool_routes(app, ctx)   # admin: /v1/nodes/{node}/warm-pool (edge/warm_pool.py)
    from dsec.apiserver.image_routes import add_image_routes
    add_image_routes(app, ctx)    # /v1/images/build (Dockerfile), /import, /pull: NDJSON progress

    @app.get("/v1/nodes", response_model=list[NodeStatus])
    async def nodes(who: Who) -> list[NodeStatus]:
        views = ctx.watcher.nodes()
        if who.project_id == ctx.iam.root().id:
            return views
        # which images a node holds hints at other projects' work: admins only (D34)
        return [n.model_copy(update={"cached_images": frozenset()}) for n in views]

    @app.get("/v1/images", response_model=ImageList)
    async def images(who: Who) -> ImageList:
        """Images and layers this project may use: its own, its relatives', and published ones."""
        if ctx.images is None:
            raise Unavailable("this apiserver has no image registry attached")
        return ImageList(images=[i for i in ctx.images.list() if visible(ctx.iam, who, i)])

    @app.post("/v1/images/{name}/publish", response_model=ImageInfo)
    async def publish_image(name: str, who: Who) -> ImageInfo:
        """Admin only: make an image or layer usable by every project (it has no owner then)."""
        if ctx.images is None:
            raise Unavailable("this apiserver has no image registry attached")
        if who.project_id != ctx.iam.root().id:
            raise Forbidden("only an admin (a key of the root project) publishes images to all projects",
                            field="name", fix="ask an admin to publish it")
        ctx.images.get(name, "name")
        return ctx.images.registry.set_owner(name, None)

    return app
