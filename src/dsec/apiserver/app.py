"""The apiserver: the one ingress between trusted callers and untrusted sandboxes.

It keeps no per-sandbox state. A sandbox id names its node, so every request after creation is
forwarded straight to that node's edge; creation asks placement for a node.

Here: the app, its error handlers and schema. The routes of dsec's own API are one router per
resource (routes/), sharing one dependency module (deps.py: who is calling, the context, the
lookups that hide other projects' ids); every policy decision is control.py's.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsec.apiserver.audit import AuditRecorder, audit_log
from dsec.apiserver.context import ApiContext
from dsec.apiserver.guard import QUERY_KEY_PATHS, BodyTooLarge, RequestGuard
from dsec.apiserver.events import pump
from dsec.apiserver.index import keeper
from dsec.apiserver.observability_off import ObservabilityOff
from dsec.apiserver.webhooks import worker
from dsec import metrics
from dsec.apiserver.ui_routes import UI_PATHS, add_ui_routes
from dsec.apiserver.routes import audit as audit_routes
from dsec.apiserver.routes import events, execs, files, nodes, policy, sandboxes, snapshots, volume_files, volumes
from dsec.types import (CapacityExceeded, ContainerArgs, DsecError, ErrorBody, FnCallRequest, InternalError,
                        InvalidArgument, MicroVMArgs, NotFound, Unavailable, VMArgs)

log = logging.getLogger("dsec.apiserver")

BACKEND_TAGS = {"container": ContainerArgs, "microvm": MicroVMArgs, "vm": VMArgs}


def _fields_for(path: str, loc: tuple) -> list[str]:
    """Allowed fields of the model a request was validated against (for the error's fix)."""
    if path.startswith("/v1/fncall"):
        return list(FnCallRequest.model_fields)
    tag = next((str(p) for p in loc if str(p) in BACKEND_TAGS), "container")
    return list(BACKEND_TAGS[tag].model_fields)


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
        from dsec.apiserver.rulesets import push_at_start
        await push_at_start(ctx)     # operators' network rule sets, to every edge
        if observed:
            pump(ctx).start()            # lifecycle events from the edges into the control store
            worker(ctx).start()          # ... and their webhook deliveries (apiserver/webhooks.py)
            audit_log(ctx).start()       # the audit log's batched writes (apiserver/audit.py)
        yield
        if observed:
            await audit_log(ctx).stop()
            await worker(ctx).stop()
            await pump(ctx).stop()
        await keeper(ctx).stop()     # the sandbox index's queued writes (apiserver/index.py)

    # DSEC_OBSERVABILITY=0: no metric updates, events, webhooks or audit log (observability_off.py)
    observed = ctx.settings.observability.enabled
    metrics.set_enabled(observed)
    app = FastAPI(title="dsec", version="0.1.0", lifespan=lifespan,
                  description="Elastic sandboxes for agent training and evaluation")
    app.state.ctx = ctx
    public = frozenset(p for p in ("/healthz", app.openapi_url, app.docs_url, app.redoc_url,
                                   app.swagger_ui_oauth2_redirect_url) if p) | UI_PATHS
    # who did what (audit.py): inside the guard, which authenticated the key
    if observed:
        app.add_middleware(AuditRecorder, ctx=ctx)
    else:
        app.add_middleware(ObservabilityOff)
    # authenticate from the headers, then bound the body per route (guard.py)
    app.add_middleware(RequestGuard, authenticate=ctx.iam.authenticate, public_paths=public,
                       image_body_bytes=ctx.settings.server.image_upload_max_bytes,
                       store_wait_s=ctx.settings.cluster.db_request_wait_s)
    if ctx.settings.observability.traces_on:    # outermost: a refused request is traced too
        from dsec.apiserver.tracing_mw import TraceMiddleware
        app.add_middleware(TraceMiddleware)
    _add_openapi(app, public)

    # -- errors: always JSON {"error": {code, message, field, fix}} ------------------------
    @app.exception_handler(DsecError)
    async def _dsec_error(_: Request, e: DsecError) -> JSONResponse:
        # a refusal that passes (a sandbox's exec slots, edge/live.py) says when to retry
        retry = getattr(e, "retry_after_s", None)
        headers = {"Retry-After": str(retry)} if isinstance(e, (CapacityExceeded, Unavailable)) and retry else None
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

    # -- routes --------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "nodes": len(ctx.edges)}

    for resource in (sandboxes, policy, snapshots, execs, files, volumes, volume_files, events, audit_routes):
        app.include_router(resource.router)
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
    app.include_router(nodes.router)   # /v1/nodes, /v1/images, publishing
    from dsec.apiserver.node_admin import add_node_admin_routes
    add_node_admin_routes(app, ctx)   # admin: /v1/nodes/{node}/cordon, drain, uncordon, forget
    from dsec.apiserver.routes import secrets as secret_routes
    app.include_router(secret_routes.router)   # /v1/secrets: added at the egress proxy (issue 30)
    from dsec.apiserver.metrics_routes import router as metrics_router
    app.include_router(metrics_router)   # /metrics (admin), /v1/metrics, per-node, per-sandbox usage
    from dsec.apiserver.rulesets import router as rulesets_router
    app.include_router(rulesets_router)   # /v1/network/rulesets: operators' named rule sets
    add_ui_routes(app)            # /ui: the web dashboard's static files (apiserver/ui/)
    return app
