"""E2B's lifecycle events API and webhooks on dsec's events (docs/events.md, docs/e2b.md):
`GET /events/sandboxes[/{sandboxID}]` (offset, limit, orderAsc) and `/events/webhooks` CRUD.
Webhooks made here are signed and shaped as E2B's (scheme 'e2b', apiserver/webhooks.py);
dsec's end reason rides in eventData (reason, infrastructure, message)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import Body, FastAPI, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec.apiserver.deps import is_admin
from dsec.apiserver.e2b.ids import to_dsec
from dsec.apiserver.events import pump
from dsec.apiserver.guard import principal_of
from dsec.apiserver.routes.events import add_webhook, visible_projects
from dsec.apiserver.webhooks import E2B_TYPES, check_target, e2b_payload, worker
from dsec.apiserver.context import ApiContext
from dsec.iam import Principal
from dsec.types import EventType, InvalidArgument, SandboxEvent, Unauthorized, WebhookCreate, WebhookInfo

FROM_E2B = {v: k for k, v in E2B_TYPES.items()}
LABELS = {"created": "create", "ended": "kill", "paused": "pause", "resumed": "resume", "updated": "update"}


class E2BWebhook(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field("", max_length=200)
    url: str | None = Field(None, max_length=2048)
    enabled: bool = True
    events: list[str] | None = None
    signatureSecret: str | None = Field(None, max_length=256)


def _who(request: Request) -> Principal:
    p = principal_of(request)
    if p is None:
        raise Unauthorized("no API key", field="X-API-KEY", fix="set E2B_API_KEY to a dsec API key")
    return p


def _types(events: list[str] | None) -> list[EventType] | None:
    if events is None:
        return None
    bad = [e for e in events if e not in FROM_E2B]
    if bad:
        raise InvalidArgument(f"events: unknown event type(s) {', '.join(map(repr, bad[:5]))}", field="events",
                              fix="use " + ", ".join(sorted(FROM_E2B)))
    return [EventType(FROM_E2B[e]) for e in events]


def _hook(h: WebhookInfo) -> dict[str, Any]:
    created = datetime.fromtimestamp(h.created_at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"id": h.id, "teamId": h.project, "teamID": h.project, "name": h.name, "createdAt": created,
            "enabled": h.enabled, "url": h.url,
            "events": [E2B_TYPES[e] for e in (h.events or list(E2B_TYPES))]}


def _event(e: SandboxEvent) -> dict[str, Any]:
    return {**e2b_payload(e), "eventCategory": "lifecycle", "eventLabel": LABELS[e.type.value]}


def add_event_routes(app: FastAPI, ctx: ApiContext) -> None:
    async def page(request: Request, sandbox_id: str | None, offset: int, limit: int, asc: bool) -> list[dict]:
        projects = await asyncio.to_thread(visible_projects, ctx, _who(request))
        store = pump(ctx).store
        events = await asyncio.to_thread(store.list_events, 0, projects, sandbox_id=sandbox_id, limit=100_000)
        if not asc:
            events.reverse()
        return [_event(e) for e in events[offset:offset + limit]]

    @app.get("/events/sandboxes")
    async def team_events(request: Request, offset: Annotated[int, Query(ge=0)] = 0,
                          limit: Annotated[int, Query(ge=1, le=100)] = 10,
                          order_asc: Annotated[bool, Query(alias="orderAsc")] = False) -> list[dict]:
        return await page(request, None, offset, limit, order_asc)

    @app.get("/events/sandboxes/{sandbox_id}")
    async def sandbox_events(request: Request, sandbox_id: str, offset: Annotated[int, Query(ge=0)] = 0,
                             limit: Annotated[int, Query(ge=1, le=100)] = 10,
                             order_asc: Annotated[bool, Query(alias="orderAsc")] = False) -> list[dict]:
        return await page(request, to_dsec(sandbox_id), offset, limit, order_asc)

    @app.post("/events/webhooks", status_code=201)
    async def register(request: Request, body: Annotated[E2BWebhook, Body()]) -> dict:
        if not body.url:
            raise InvalidArgument("url is required", field="url", fix="give the URL events are POSTed to")
        if not body.signatureSecret:
            raise InvalidArgument("signatureSecret is required", field="signatureSecret",
                                  fix="give the secret deliveries are signed with (e2b-signature)")
        # E2B takes any secret (dsec's own route asks 16+ characters)
        try:
            req = WebhookCreate(url=body.url, events=_types(body.events), name=body.name).model_copy(
                update={"secret": body.signatureSecret})
        except ValidationError as e:
            first = e.errors()[0]
            name = ".".join(str(p) for p in first.get("loc", ())) or "body"
            raise InvalidArgument(f"{name}: {first.get('msg', 'invalid')}", field=name,
                                  fix="url: an http(s) URL, e.g. https://hooks.example.com/e2b") from None
        info = await asyncio.to_thread(add_webhook, ctx, _who(request), req, "e2b")
        if not body.enabled:
            await asyncio.to_thread(pump(ctx).store.update_webhook, info.id, enabled=False)
            info = info.model_copy(update={"enabled": False})
        worker(ctx).start()
        return _hook(info)

    async def mine(request: Request, webhook_id: str) -> WebhookInfo:
        projects = await asyncio.to_thread(visible_projects, ctx, _who(request))
        return await asyncio.to_thread(pump(ctx).store.webhook, webhook_id, projects)

    @app.get("/events/webhooks")
    async def list_hooks(request: Request) -> list[dict]:
        projects = await asyncio.to_thread(visible_projects, ctx, _who(request))
        return [_hook(h) for h in await asyncio.to_thread(pump(ctx).store.webhooks, projects)]

    @app.get("/events/webhooks/{webhook_id}")
    async def get_hook(request: Request, webhook_id: str) -> dict:
        return _hook(await mine(request, webhook_id))

    @app.patch("/events/webhooks/{webhook_id}")
    async def update_hook(request: Request, webhook_id: str, body: Annotated[dict, Body()]) -> dict:
        """Replace the fields given (url, enabled, events, signatureSecret)."""
        h = await mine(request, webhook_id)
        fields: dict[str, Any] = {}
        if "url" in body:
            url = str(body["url"])
            allow = ctx.settings.events.webhook_private_ok or is_admin(ctx, _who(request))
            await asyncio.to_thread(check_target, url, allow)
            fields["url"], fields["private_ok"] = url, allow
        if "enabled" in body:
            fields["enabled"] = bool(body["enabled"])
        if "events" in body:
            types = _types(list(body["events"]) if body["events"] is not None else None)
            fields["events"] = [t.value for t in types] if types is not None else None
        if body.get("signatureSecret"):
            fields["secret"] = str(body["signatureSecret"])
        if "name" in body:
            fields["name"] = str(body["name"])[:200]
        await asyncio.to_thread(pump(ctx).store.update_webhook, h.id, **fields)
        return _hook(await mine(request, webhook_id))

    @app.delete("/events/webhooks/{webhook_id}")
    async def delete_hook(request: Request, webhook_id: str) -> Response:
        h = await mine(request, webhook_id)
        await asyncio.to_thread(pump(ctx).store.delete_webhook, h.id)
        return Response(status_code=200)
