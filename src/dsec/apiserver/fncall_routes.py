"""HTTP routes of the FnCall backend, and a SandboxFusion-compatible `POST /run_code`.

    POST /v1/fncall         FnCallRequest -> FnCallResult
    POST /v1/fncall/batch   FnCallBatch -> NDJSON FnCallBatchItem lines, in completion order
    POST /run_code          SandboxFusion's RunCodeRequest -> RunCodeResponse (same field names
                            and status strings), so verl's sandbox_fusion tool and reward code
                            switch to dsec by changing their URL. Those clients send no
                            Authorization header, so the key may also come as ?api_key=...
                            (e.g. http://host:7620/run_code?api_key=dsk_...) or in the path:
                            http://host:7620/sf/dsk_.../run_code (sf_keypath.py), for clients
                            that append the route to a base URL (SkyRL, sandbox-fusion).
    POST /run_jupyter       SandboxFusion's RunJupyterRequest -> RunJupyterResponse (sf_jupyter.py)
    GET  /v1/ping           SandboxFusion's liveness check: "pong"

Placement: every node offering "fncall" can serve a call; calls of one (image, language) go to
the same node (rendezvous hashing) so they land on its warm pool instead of warming pools on
every node.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
from collections.abc import AsyncIterator
from enum import Enum
from typing import TYPE_CHECKING, Optional

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from dsec.apiserver.deps import caller, is_admin
from dsec.apiserver.guard import RUN_CODE_AUTH_FIX
from dsec.apiserver.sf_jupyter import RunJupyterRequest, RunJupyterResponse, run_jupyter
from dsec.apiserver.sf_jupyter import sandbox_error as jupyter_sandbox_error
from dsec.apiserver.sf_keypath import PathKeyMiddleware
from dsec.apiserver.tenancy import check_visible
from dsec.fncall import languages
from dsec.iam import Principal
from dsec.types import (FNCALL_DEFAULT_IMAGE, FNCALL_MAX_TIMEOUT_S, DsecError, FnCallBatch, FnCallBatchItem, FnCallRequest, FnCallResult,
                        FnCallStatus, InvalidArgument, NotFound, Unauthorized, Unavailable)

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext

log = logging.getLogger("dsec.apiserver.fncall")


# ---------------------------------------------------------------------------------------------
# SandboxFusion wire models (its public run_code API: field names and status strings match)
# ---------------------------------------------------------------------------------------------

class CommandRunStatus(str, Enum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: Optional[float] = None
    return_code: Optional[int] = None
    stdout: Optional[str] = None
    stderr: Optional[str] = None


class RunStatus(str, Enum):
    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class RunCodeRequest(BaseModel):
    # SandboxFusion ignores unknown fields; so do we, so that any of its clients work unchanged.
    model_config = ConfigDict(extra="ignore")

    code: str = Field(description="the code to run")
    language: str = Field(description="python, cpp, bash, ... (SandboxFusion names)")
    compile_timeout: float = Field(10, gt=0, le=FNCALL_MAX_TIMEOUT_S)
    run_timeout: float = Field(10, gt=0, le=FNCALL_MAX_TIMEOUT_S)
    memory_limit_MB: int = Field(-1, description="-1: dsec's default")
    stdin: Optional[str] = None
    files: dict[str, Optional[str]] = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: list[str] = Field(default_factory=list)
    args: list[str] = Field(default_factory=list, description="command-line arguments of the program")
    # dsec's own: SandboxFusion clients send none, and get fncall-python or fncall-polyglot by language
    image: Optional[str] = Field(None, description="pool image (default: by language)")


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str
    compile_result: Optional[CommandRunResult] = None
    run_result: Optional[CommandRunResult] = None
    executor_pod_name: Optional[str] = None
    files: dict[str, str] = Field(default_factory=dict)


def to_fncall_request(req: RunCodeRequest) -> FnCallRequest:
    files_b64 = {}
    for path, content in req.files.items():
        if content is None:
            continue
        try:
            base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(f"files[{path!r}] is not base64", field="files",
                                  fix="send file contents base64-encoded, as SandboxFusion expects") from None
        files_b64[path[2:] if path.startswith("./") else path] = content
    fields: dict = {"code": req.code, "language": req.language, "stdin": req.stdin,
                    "files_b64": files_b64, "fetch_files": req.fetch_files, "args": req.args,
                    "timeout_s": req.run_timeout, "compile_timeout_s": req.compile_timeout,
                    "image": req.image or languages.image_for(req.language, FNCALL_DEFAULT_IMAGE)}
    if req.memory_limit_MB > 0:
        fields["memory_mb"] = max(16, min(req.memory_limit_MB, 4096))
    try:
        return FnCallRequest(**fields)
    except ValueError as e:
        errs = getattr(e, "errors", lambda: [])()
        loc = ".".join(str(p) for p in errs[0]["loc"]) if errs else "body"
        raise InvalidArgument(f"{loc}: {errs[0]['msg'] if errs else e}", field=loc) from None


def _command(step, *, timed_out: bool | None = None) -> CommandRunResult:
    if step.timed_out if timed_out is None else timed_out:
        return CommandRunResult(status=CommandRunStatus.TimeLimitExceeded, execution_time=step.wall_s,
                                stdout=step.stdout, stderr=step.stderr)
    code = step.exit_code if step.exit_code is not None else -(step.signal or 0)   # like subprocess
    return CommandRunResult(status=CommandRunStatus.Finished, execution_time=step.wall_s, return_code=code,
                            stdout=step.stdout, stderr=step.stderr)


def to_run_code_response(res: FnCallResult) -> RunCodeResponse:
    if res.status == FnCallStatus.sandbox_error:
        return RunCodeResponse(status=RunStatus.SandboxError, message=res.error or "sandbox error",
                               executor_pod_name=res.executor)
    comp = _command(res.compile) if res.compile is not None else None
    run = None
    if res.run is not None:
        run = _command(res.run, timed_out=res.run.timed_out or res.status == FnCallStatus.timeout)
    outcomes = [c for c in (comp, run) if c is not None]
    ok = all(c.status == CommandRunStatus.Finished and c.return_code == 0 for c in outcomes) and run is not None
    return RunCodeResponse(status=RunStatus.Success if ok else RunStatus.Failed, message="",
                           compile_result=comp, run_result=run, executor_pod_name=res.executor,
                           files=res.files)


# ---------------------------------------------------------------------------------------------
# routes
# ---------------------------------------------------------------------------------------------

def _rendezvous(nodes: list[str], key: str) -> list[str]:
    return sorted(nodes, key=lambda n: hashlib.sha256(f"{n}\0{key}".encode()).digest(), reverse=True)


def add_fncall_routes(app: FastAPI, ctx: "ApiContext") -> None:
    # added after RequestGuard (create_app), so it runs before it: the guard only ever sees
    # /run_code with a Bearer key, never a key in the path
    app.add_middleware(PathKeyMiddleware)

    def nodes_for(req: FnCallRequest) -> list[str]:
        healthy = [n.node_id for n in ctx.watcher.nodes()
                   if n.healthy and "fncall" in n.backends and n.node_id in ctx.fncall]
        if not healthy:
            raise Unavailable("no healthy node offers the fncall backend", fix="retry later; see GET /v1/nodes")
        return _rendezvous(healthy, f"{req.image}\0{req.language.lower()}")

    async def run_one(req: FnCallRequest, who: Principal) -> FnCallResult:
        if ctx.images is not None:
            check_visible(ctx.iam, who, "image", req.image, ctx.images.get(req.image, "image"))
        last: DsecError | None = None
        for node in nodes_for(req)[:2]:       # the preferred node, then one fallback
            try:
                if ctx.images is None:        # no registry here (cluster replicas): the node's says the owner
                    info = (await ctx.edges[node].resolve_images([("image", req.image)]))[0]
                    check_visible(ctx.iam, who, "image", req.image, info)
                return await ctx.fncall[node].run(req, project=who.project_id)   # its own compile cache
            except Unavailable as e:          # that node is shutting down
                last = e
        assert last is not None
        raise last

    @app.post("/v1/fncall", response_model=FnCallResult, tags=["fncall"])
    async def fncall(req: FnCallRequest, request: Request) -> FnCallResult:
        """Run one short stateless program in a warm container."""
        return await run_one(req, caller(request))

    @app.post("/v1/fncall/batch", tags=["fncall"],
              responses={200: {"content": {"application/x-ndjson": {}},
                               "description": "one FnCallBatchItem per line, in completion order"}})
    async def fncall_batch(batch: FnCallBatch, request: Request) -> StreamingResponse:
        """Run many calls; each result is one NDJSON line as soon as it is ready. A call that
        cannot run reports status sandbox-error; it never fails the batch."""
        who = caller(request)

        async def one(i: int, req: FnCallRequest) -> FnCallBatchItem:
            try:
                res = await run_one(req, who)
            except DsecError as e:
                res = FnCallResult(status=FnCallStatus.sandbox_error, language=req.language,
                                   error=f"{e.code}: {e.message}" + (f" (field {e.field})" if e.field else ""))
            return FnCallBatchItem(index=i, result=res)

        async def lines() -> AsyncIterator[bytes]:
            tasks = {asyncio.create_task(one(i, r)) for i, r in enumerate(batch.calls)}
            pending = set(tasks)
            try:
                while pending:
                    # every result that is ready goes out in one chunk: one write, one wake-up
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    yield b"".join(t.result().model_dump_json(exclude_defaults=True).encode() + b"\n"
                                   for t in done)
            finally:   # the client went away: nothing outlives the request
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/fncall/pools", tags=["fncall"])
    async def fncall_pools(request: Request) -> list[dict]:
        """Warm pools per node: workers, idle, starting, waiting callers, calls served (the
        counts of calls, node-wide and so of every project, for an admin key only)."""
        admin = is_admin(ctx, caller(request))
        out = []
        for node, service in ctx.fncall.items():
            out += [{"node": node, **{k: v for k, v in p.items() if admin or k != "calls"}}
                    for p in await service.pool_stats()]
        return out

    @app.post("/run_jupyter", response_model=RunJupyterResponse, tags=["fncall"])
    async def run_jupyter_route(req: RunJupyterRequest, request: Request) -> RunJupyterResponse:
        """SandboxFusion-compatible: cells run in order in one Jupyter kernel of a fresh sandbox."""
        who = caller(request)
        try:
            return await run_jupyter(ctx, who, req)
        except InvalidArgument:
            raise
        except DsecError as e:
            return jupyter_sandbox_error(e, ctx.settings.server.pod_name)

    @app.get("/v1/ping", tags=["fncall"])
    async def ping(request: Request) -> str:
        """SandboxFusion's liveness check."""
        caller(request)
        return "pong"

    @app.post("/run_code", response_model=RunCodeResponse, tags=["fncall"])
    async def run_code(req: RunCodeRequest, request: Request) -> RunCodeResponse:
        """SandboxFusion-compatible: what verl's sandbox_fusion tool and reward code call."""
        try:
            who = caller(request)
        except Unauthorized as e:
            raise Unauthorized(e.message, field=e.field, fix=RUN_CODE_AUTH_FIX) from None
        try:
            fc = to_fncall_request(req)
            res = await run_one(fc, who)
        except InvalidArgument:
            raise
        except DsecError as e:
            missing_image = isinstance(e, NotFound) and e.field == "image"
            return RunCodeResponse(status=RunStatus.SandboxError,
                                   message=e.message + (f"; fix: dsec image build {fc.image} --builtin"
                                                        if missing_image else ""),
                                   executor_pod_name=ctx.settings.server.pod_name)
        return to_run_code_response(res)
