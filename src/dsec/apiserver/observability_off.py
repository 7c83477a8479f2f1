"""DSEC_OBSERVABILITY=0: the routes of what is then not kept (lifecycle events, webhooks, the
audit log) answer 409 naming the setting, rather than an empty list that looks like a quiet
fleet. ASGI middleware inside RequestGuard (a caller without a key still gets 401 first)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Scope

from dsec.types import Conflict

# native /v1/events, /v1/webhooks..., /v1/audit; E2B's /events/sandboxes..., /events/webhooks...
OFF_PATHS = re.compile(r"^(/v1/(events|webhooks|audit)|(/e2b)?/events/(sandboxes|webhooks))(/|$)")


class ObservabilityOff:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http" or not OFF_PATHS.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        err = Conflict("lifecycle events, webhooks and the audit log are off on this server "
                       "(DSEC_OBSERVABILITY=0)", field="DSEC_OBSERVABILITY",
                       fix="unset DSEC_OBSERVABILITY (or set it to 1) on the server and restart it")
        await JSONResponse(err.to_body(), status_code=err.status)(scope, receive, send)
