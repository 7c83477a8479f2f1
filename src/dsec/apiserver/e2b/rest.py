"""E2B's REST API (the control plane the e2b SDK calls with `X-API-KEY`), on dsec.

A FastAPI sub-application mounted under E2B_PREFIX, with its own error handlers: every error
is E2B's `{"code", "message"}`. See docs/e2b.md for the mapping of each route and field.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote

from fastapi import Body, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsec.apiserver import listing
from dsec.apiserver.control import set_network as set_sandbox_network
from dsec.iam.policy import default_internet
from dsec.apiserver.control import stop_sandbox
from dsec.apiserver.context import ApiContext
from dsec.apiserver.e2b import control, layout, mapping, snapshot_names
from dsec.apiserver.e2b.auth import AccessTokens
from dsec.apiserver.e2b.errors import NotImplementedE2B, Unsupported, e2b_response
from dsec.apiserver.e2b.ids import to_dsec, to_e2b
from dsec.apiserver.e2b.models import ConnectBody, NewSandbox, PauseBody, TimeoutBody
from dsec.apiserver.guard import principal_of
from dsec.iam import Principal
from dsec.types import (MAX_TTL_S, VM_BACKENDS, Conflict, DsecError, InternalError, InvalidArgument, NetworkPolicy, NotFound,
                        SandboxInfo, SandboxState, Unauthorized)

log = logging.getLogger("dsec.apiserver.e2b")

# E2B routes the SDK has that dsec does not serve: a clear 501 instead of a bare 404
NOT_SERVED = ("logs", "refreshes")
MAX_METRICS_IDS = 100      # sandboxes one GET /sandboxes/metrics reports


def _who(request: Request) -> Principal:
    p = principal_of(request)
    if p is None:    # the guard authenticates every E2B REST request; this is a safety net
        raise Unauthorized("no API key", field="X-API-KEY", fix="set E2B_API_KEY to a dsec API key")
    return p


def _gone(e2b_id: str) -> NotFound:
    return NotFound(f"sandbox {e2b_id} not found", field="sandboxID",
                    fix="it was killed or reached its timeout; list running ones with Sandbox.list()")


def _check_timeout(timeout: int) -> float:
    if not 0 < timeout <= MAX_TTL_S:
        raise InvalidArgument(f"timeout {timeout} must be 1..{MAX_TTL_S} seconds", field="timeout",
                              fix=f"pass at most {MAX_TTL_S} (7 days)")
    return float(timeout)


def build_rest_app(ctx: ApiContext, tokens: AccessTokens, domain: str | None = None) -> FastAPI:
    app = FastAPI(title="dsec E2B API", openapi_url=None, docs_url=None, redoc_url=None)
    _add_error_handlers(app)

    async def running(e2b_id: str, who: Principal) -> SandboxInfo:
        """A running or paused sandbox of the caller's (ended ones are gone to E2B)."""
        try:
            _, info = await control.owned(ctx, to_dsec(e2b_id), who)
        except NotFound:
            raise _gone(e2b_id) from None
        if mapping.e2b_state(info) is None:
            raise _gone(e2b_id)
        return info

    @app.post("/sandboxes", status_code=201)
    @app.post("/v2/sandboxes", status_code=201)
    async def create(request: Request, body: Annotated[NewSandbox, Body()],
                     idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None) -> dict:
        who = _who(request)
        if (named := await snapshot_names.resolve(ctx, who, body.template_id)) is not None:
            body = body.model_copy(update={"template_id": named})     # a snapshot's name (E2B)
        internet = default_internet(ctx.iam.effective_policy(who.project_id))
        args = await control.with_image_config(ctx, who, mapping.sandbox_args(body, idempotency_key, internet))
        info = await control.create(ctx, who, args, mapping.transform_rules(body.network))
        await layout.apply(ctx.edge_for(info.id), info)       # before anything runs as `user`
        await control.start_template_services(ctx, info)
        return mapping.created(info, tokens, domain)

    # usage samples (edge/usage.py) as E2B's SandboxMetric; before /sandboxes/{sandbox_id}
    @app.get("/sandboxes/metrics")
    async def many_metrics(request: Request, sandbox_ids: str) -> dict:
        """The latest sample of each named sandbox of the caller's (unknown ones left out)."""
        who = _who(request)
        ids = [i for i in sandbox_ids.split(",") if i][:MAX_METRICS_IDS]
        out: dict[str, dict] = {}
        for e2b_id in ids:
            try:
                info = await running(e2b_id, who)
            except NotFound:
                continue
            samples = await ctx.edge_for(info.id).usage(info.id)
            if samples:
                out[e2b_id] = mapping.metric(samples[-1])
        return {"sandboxes": out}

    @app.get("/sandboxes/{sandbox_id}/metrics")
    async def sandbox_metrics(request: Request, sandbox_id: str, start: int | None = None, end: int | None = None) -> list[dict]:
        info = await running(sandbox_id, _who(request))
        samples = await ctx.edge_for(info.id).usage(info.id, start, end)
        return [mapping.metric(s) for s in samples]

    @app.get("/sandboxes/{sandbox_id}")
    async def get(request: Request, sandbox_id: str) -> dict:
        info = await running(sandbox_id, _who(request))
        return mapping.detail(info, tokens, domain)

    @app.get("/sandboxes")
    @app.get("/v2/sandboxes")
    async def list_(request: Request, response: Response, metadata: str | None = None,
                    state: str | None = None, order: str | None = None,
                    started_after: Annotated[datetime | None, Query(alias="startedAfter")] = None,
                    template: str | None = None, next_token: Annotated[str | None, Query(alias="nextToken")] = None,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[dict]:
        who = _who(request)
        # every node at once, a dead one's sandboxes as last indexed (apiserver/listing.py)
        infos = (await listing.list_sandboxes(ctx, who)).sandboxes
        picked = _filter(infos, _metadata_query(metadata), _states(state), started_after, template)
        picked.sort(key=lambda i: (i.created_at, i.id), reverse=order == "desc")
        page, token = _page(picked, next_token, limit)
        if token:
            response.headers["x-next-token"] = token
        return [mapping.listed(i) for i in page]

    @app.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def kill(request: Request, sandbox_id: str) -> Response:
        info = await running(sandbox_id, _who(request))
        await stop_sandbox(ctx, ctx.edge_for(info.id), info.id, reason="killed through the E2B API")
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    async def set_timeout(request: Request, sandbox_id: str, body: TimeoutBody) -> Response:
        info = await running(sandbox_id, _who(request))
        await ctx.edge_for(info.id).set_timeout(info.id, _check_timeout(body.timeout))
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/pause", status_code=204)
    async def pause(request: Request, sandbox_id: str, body: Annotated[PauseBody | None, Body()] = None) -> Response:
        info = await running(sandbox_id, _who(request))
        _check_pausable(info, body or PauseBody())
        if info.state == SandboxState.suspended:
            raise Conflict(f"sandbox {sandbox_id} is already paused", field="sandboxID", fix="resume it with connect")
        await ctx.edge_for(info.id).suspend(info.id)
        return Response(status_code=204)

    @app.put("/sandboxes/{sandbox_id}/network", status_code=204)
    async def update_network(request: Request, sandbox_id: str, body: Annotated[dict[str, Any], Body()]) -> Response:
        """E2B's update_network: the whole egress policy replaced, effective for new connections."""
        info = await running(sandbox_id, _who(request))
        if info.backend in VM_BACKENDS:
            raise Unsupported("network: dsec VMs have no network device", field="network",
                              fix="use a container sandbox (the default) for network access")
        body = dict(body)
        internet = body.pop("allowInternetAccess", None)
        if internet is not None and not isinstance(internet, bool):
            raise InvalidArgument("allowInternetAccess must be true or false", field="allowInternetAccess",
                                  fix="send a boolean")
        if internet is None:     # E2B's default (on), where the project's egress allows it
            internet = default_internet(ctx.iam.effective_policy(info.project))
        raw = mapping.network_policy(body, internet, prefix="network")
        mapping.check_kept_proxy(raw, info.network)
        await set_sandbox_network(ctx, ctx.edge_for(info.id), info.id,
                                  NetworkPolicy.model_validate(raw or {}))
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/connect")
    @app.post("/v2/sandboxes/{sandbox_id}/connect")
    @app.post("/sandboxes/{sandbox_id}/resume")
    async def connect(request: Request, sandbox_id: str,
                      body: Annotated[ConnectBody | None, Body()] = None) -> JSONResponse:
        """Running: 200 (the timeout only grows). Paused (suspended): resumed, 201."""
        body = body or ConnectBody()
        info = await running(sandbox_id, _who(request))
        edge = ctx.edge_for(info.id)
        if body.auto_pause:
            raise Unsupported("autoPause: dsec cannot pause a sandbox when its timeout passes", field="autoPause",
                              fix="leave autoPause unset")
        status = 200
        if info.state == SandboxState.suspended:
            if body.memory is False:
                raise Unsupported("memory: dsec resumes a paused sandbox with its memory; a cold reboot "
                                  "is not available", field="memory", fix="connect with on_resume='restore'")
            info = await edge.resume(info.id)
            status = 201
        if body.timeout is not None:
            info = await _grow_timeout(edge, info, _check_timeout(body.timeout))
        return JSONResponse(mapping.created(info, tokens, domain), status_code=status)

    from dsec.apiserver.e2b.snapshots import add_snapshot_routes
    add_snapshot_routes(app, ctx, tokens, domain)     # fork, snapshots (before the catch-all)
    from dsec.apiserver.e2b.templates import add_template_routes
    add_template_routes(app, ctx)      # before the catch-all below
    from dsec.apiserver.e2b.volumes import add_volume_routes
    add_volume_routes(app, ctx, tokens)
    from dsec.apiserver.e2b.events import add_event_routes
    add_event_routes(app, ctx)         # /events/sandboxes, /events/webhooks (docs/events.md)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def not_served(path: str, request: Request) -> Response:
        parts = path.split("/")
        if parts and parts[-1] in NOT_SERVED or "templates" in parts or "volumecontent" in parts:
            raise NotImplementedE2B(f"E2B route {request.method} /{path[:120]} is not served by dsec",
                                    field="path", fix="see docs/e2b.md for the routes dsec serves")
        raise NotFound(f"no E2B route {request.method} /{path[:120]} in dsec", field="path",
                       fix="see docs/e2b.md for the routes dsec serves")

    return app


async def _grow_timeout(edge: object, info: SandboxInfo, timeout_s: float) -> SandboxInfo:
    """E2B's connect only lengthens a running sandbox's timeout."""
    new_end = datetime.now(timezone.utc).timestamp() + timeout_s
    if info.expires_at is None or new_end > info.expires_at.timestamp():
        return await edge.set_timeout(info.id, timeout_s)     # type: ignore[attr-defined, no-any-return]
    return info


def _check_pausable(info: SandboxInfo, body: PauseBody) -> None:
    # every backend parks with its memory: a VM on disk, a container frozen in place
    if body.memory is False:
        raise Unsupported("memory: dsec pauses a sandbox with its memory; a filesystem-only pause is not available",
                          field="memory", fix="pause with mode='full' (the default)")


def _metadata_query(raw: str | None) -> dict[str, str]:
    """The SDK sends metadata as urlencode({quote(k): quote(v)}): decoded twice."""
    if not raw:
        return {}
    return {unquote(k): unquote(v) for k, v in parse_qsl(raw, keep_blank_values=True)}


def _states(raw: str | None) -> set[str]:
    states = {s for s in (raw or "running,paused").split(",") if s}
    bad = states - {"running", "paused"}
    if bad:
        raise InvalidArgument(f"state {sorted(bad)[0]!r} is not 'running' or 'paused'", field="state",
                              fix="filter by running, paused or both")
    return states


def _filter(infos: list[SandboxInfo], metadata: dict[str, str], states: set[str],
            started_after: datetime | None, template: str | None) -> list[SandboxInfo]:
    def keep(i: SandboxInfo) -> bool:
        st = mapping.e2b_state(i)
        return (st in states and all(i.labels.get(k) == v for k, v in metadata.items())
                and (started_after is None or i.created_at >= _aware(started_after))
                and (template is None or i.image == template))
    return [i for i in infos if keep(i)]


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.astimezone()


def _page(items: list[SandboxInfo], token: str | None, limit: int) -> tuple[list[SandboxInfo], str | None]:
    """Pages after the sandbox named by the token (the last id of the previous page)."""
    start = 0
    if token:
        ids = [to_e2b(i.id) for i in items]
        if token not in ids:
            raise InvalidArgument("nextToken does not name a sandbox of this listing (it ended meanwhile?)",
                                  field="nextToken", fix="list again from the first page")
        start = ids.index(token) + 1
    page = items[start:start + limit]
    more = start + limit < len(items)
    return page, (to_e2b(page[-1].id) if more and page else None)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(DsecError)
    async def _dsec(_: Request, e: DsecError) -> JSONResponse:
        return e2b_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = (e.errors() or [{}])[0]
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
        field = ".".join(loc) or "body"
        msg = "body is not valid JSON" if first.get("type") == "json_invalid" else first.get("msg", "invalid")
        if first.get("type") == "extra_forbidden":
            msg = "dsec does not know this field, so it cannot honour it"
        return e2b_response(InvalidArgument(f"{field}: {msg}", field=field, fix="see docs/e2b.md"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = DsecError(str(e.detail), field="path", fix="see docs/e2b.md")
        err.status = e.status_code
        return e2b_response(err)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=e, extra={"method": request.method, "path": request.url.path})
        return e2b_response(InternalError(f"internal error ({type(e).__name__})",
                                          fix="retry; if it persists, report it with the server log"))
