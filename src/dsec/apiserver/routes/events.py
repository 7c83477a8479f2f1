"""Lifecycle events and webhooks (docs/events.md): `GET /v1/events` (a page, or with
follow=true a stream: NDJSON, or SSE when the client accepts text/event-stream; resumed after an
id with ?after= or SSE's Last-Event-ID), and per-project webhooks with their delivery status.
A project sees its own and its sub-projects' events and webhooks; an admin key, all of them."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import Response, StreamingResponse

from dsec.apiserver.audit import note_target
from dsec.apiserver.deps import Ctx, Who, admin_only, is_admin
from dsec.apiserver.context import ApiContext
from dsec.apiserver.events import pump
from dsec.apiserver.webhooks import check_target, worker
from dsec.iam import Principal
from dsec.types import MAX_EVENT_ID, DeliveryList, EventList, InvalidArgument, WebhookCreate, WebhookInfo, WebhookList

router = APIRouter()
WebhookId = Annotated[str, PathParam(pattern=r"^wh_[0-9a-f]{16}$", description="the id POST /v1/webhooks answered")]
HEARTBEAT_S = 15.0      # a comment line on an idle stream: proxies keep it open, a gone client is noticed


def visible_projects(ctx: ApiContext, who: Principal) -> list[str] | None:
    """The projects whose events and webhooks the caller sees (None: all, an admin)."""
    if is_admin(ctx, who):
        return None
    return [p.id for p in ctx.iam.subtree(who.project_id)]


@router.get("/v1/events", response_model=EventList)
async def list_events(request: Request, who: Who, ctx: Ctx,
                      after: Annotated[int, Query(ge=0, le=MAX_EVENT_ID, description="only events with a larger id")] = 0,
                      sandbox_id: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9._-]{1,200}$")] = None,
                      limit: Annotated[int, Query(ge=1, le=1000)] = 500,
                      follow: Annotated[bool, Query(description="stream: send new events as they come")] = False,
                      last_event_id: Annotated[str | None, Header()] = None) -> Response | EventList:
    """Lifecycle events (created, paused, resumed, updated, ended with a reason), oldest first."""
    projects = await asyncio.to_thread(visible_projects, ctx, who)
    if last_event_id and last_event_id.isascii() and last_event_id.isdigit() and len(last_event_id) < 19:
        after = max(after, int(last_event_id))       # an SSE client's reconnect
    p = pump(ctx)
    if not follow:
        events = await asyncio.to_thread(p.store.list_events, after, projects, sandbox_id=sandbox_id, limit=limit)
        return EventList(events=events, last_id=events[-1].id if events else after)
    sse = "text/event-stream" in request.headers.get("accept", "")

    async def stream() -> AsyncIterator[bytes]:
        cursor = after
        while True:
            changed = p.changed
            events = await asyncio.to_thread(p.store.list_events, cursor, projects, sandbox_id=sandbox_id, limit=limit)
            for e in events:
                body = e.model_dump_json()
                yield (f"id: {e.id}\nevent: {e.type.value}\ndata: {body}\n\n" if sse else body + "\n").encode()
                cursor = e.id
            if len(events) == limit:
                continue
            try:   # this process's ingests wake it; another replica's show at the next poll
                await asyncio.wait_for(changed.wait(), min(HEARTBEAT_S, max(ctx.settings.events.poll_s, 0.5)))
            except TimeoutError:
                yield b": keep-alive\n\n" if sse else b"\n"
    return StreamingResponse(stream(), media_type="text/event-stream" if sse else "application/x-ndjson",
                             headers={"Cache-Control": "no-cache"})


def _project_for(ctx: ApiContext, who: Principal, project: str | None) -> str:
    if project is None or project == who.project_id:
        return who.project_id
    admin_only(ctx, who, "register a webhook for another project", "project")
    return ctx.iam.project(project).id     # NotFound names it


def add_webhook(ctx: ApiContext, who: Principal, req: WebhookCreate, scheme: str) -> WebhookInfo:
    """Check and store a webhook (shared by the native and the E2B route)."""
    project = _project_for(ctx, who, req.project)
    allow = ctx.settings.events.webhook_private_ok or is_admin(ctx, who)
    check_target(req.url, allow)
    if req.events is not None and not req.events:
        raise InvalidArgument("events: an empty list would send nothing", field="events",
                              fix="leave events out for all types, or list some")
    secret = req.secret or "whsec_" + secrets.token_urlsafe(24)
    events = [e.value for e in req.events] if req.events is not None else None
    return pump(ctx).store.add_webhook(project, req.url, req.name, events, secret, scheme, private_ok=allow)


@router.post("/v1/webhooks", status_code=201, response_model=WebhookInfo)
async def create_webhook(req: WebhookCreate, who: Who, ctx: Ctx) -> WebhookInfo:
    """Send this project's lifecycle events to a URL, signed (docs/events.md). The answer
    carries the secret (the only time it is shown)."""
    info = await asyncio.to_thread(add_webhook, ctx, who, req, "dsec")
    note_target(info.id)     # the audit log names it; the signing secret stays out
    worker(ctx).start()
    return info


@router.get("/v1/webhooks", response_model=WebhookList)
async def list_webhooks(who: Who, ctx: Ctx) -> WebhookList:
    projects = await asyncio.to_thread(visible_projects, ctx, who)
    return WebhookList(webhooks=await asyncio.to_thread(pump(ctx).store.webhooks, projects))


@router.get("/v1/webhooks/{webhook_id}", response_model=WebhookInfo)
async def get_webhook(webhook_id: WebhookId, who: Who, ctx: Ctx) -> WebhookInfo:
    projects = await asyncio.to_thread(visible_projects, ctx, who)
    return await asyncio.to_thread(pump(ctx).store.webhook, webhook_id, projects)


@router.delete("/v1/webhooks/{webhook_id}", status_code=204)
async def delete_webhook(webhook_id: WebhookId, who: Who, ctx: Ctx) -> Response:
    """Remove it and its queued deliveries."""
    projects = await asyncio.to_thread(visible_projects, ctx, who)
    store = pump(ctx).store
    await asyncio.to_thread(store.webhook, webhook_id, projects)
    await asyncio.to_thread(store.delete_webhook, webhook_id)
    return Response(status_code=204)


@router.get("/v1/webhooks/{webhook_id}/deliveries", response_model=DeliveryList)
async def list_deliveries(webhook_id: WebhookId, who: Who, ctx: Ctx,
                          limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> DeliveryList:
    """The webhook's latest deliveries (newest first) and how many are pending, delivered, failed."""
    projects = await asyncio.to_thread(visible_projects, ctx, who)
    store = pump(ctx).store
    await asyncio.to_thread(store.webhook, webhook_id, projects)
    items, counts = await asyncio.to_thread(store.deliveries, webhook_id, limit)
    return DeliveryList(deliveries=items, pending=counts.get("pending", 0), delivered=counts.get("delivered", 0),
                        failed=counts.get("failed", 0))
