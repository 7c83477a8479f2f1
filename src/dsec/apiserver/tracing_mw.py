"""The apiserver's server spans (dsec.tracing): one per request, continuing the caller's
trace from its `traceparent`. Added only when traces are on (app.py): off, requests pass no
extra layer at all.

Named `METHOD /route/{template}` once routing has matched (never the sandbox id in the name:
span names stay few), with the status, the project and key id of the caller, and no body,
query string or header values.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dsec import tracing
from dsec.iam import Principal

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
UNTRACED = frozenset({"/healthz", "/metrics", "/openapi.json"})


class TraceMiddleware:
    def __init__(self, app: Callable[[Scope, Any, Any], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED or scope["path"].startswith("/ui"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        status = 0

        async def noting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)
        method = scope["method"]
        with tracing.span(method, "server", {"http.request.method": method},
                          parent=tracing.extract(headers)) as span:
            try:
                await self.app(scope, receive, noting_send)
            finally:
                if span is not None:
                    route = getattr(scope.get("route"), "path", None)
                    if route:
                        span.update_name(f"{method} {scope.get('root_path', '')}{route}")
                        span.set_attribute("http.route", route)
                    span.set_attribute("http.response.status_code", status or 500)
                    who = scope.get("state", {}).get("dsec_principal")
                    if isinstance(who, Principal):
                        span.set_attribute("dsec.project", who.project_id)
                        span.set_attribute("dsec.key_id", who.key_id)
                    if status >= 500 or not status:
                        from opentelemetry.trace import Status, StatusCode
                        span.set_status(Status(StatusCode.ERROR))
