"""The API key in the URL path for SandboxFusion clients: `http://HOST:7620/sf/<KEY>` is a base
URL to which a client appends `/run_code` (SkyRL, the sandbox-fusion package: they build
`f"{endpoint}/run_code"`, so a `?api_key=` query in the base URL ends up before the route and
breaks the URL).

An ASGI middleware in front of RequestGuard. For `/sf/<KEY>/<route>` with <route> one of the
SandboxFusion routes it rewrites the request IN PLACE to `/<route>` with `Authorization: Bearer
<KEY>`, so the guard authenticates it like any other request and whatever logs the request
afterwards (uvicorn's access log reads the same scope dict; the guard's and the routes' logs read
scope["path"]) only ever sees the path without the key. For the same reason a `?api_key=` on
those routes is moved into the header and dropped from the query string. Any other `/sf/...` path
is a 404 that does not repeat the path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

from dsec.types import NotFound

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PREFIX = "/sf/"
# the routes a SandboxFusion client calls (and dsec serves): /run_code, /run_jupyter, /v1/ping
SF_ROUTES = re.compile(r"^/(run_code|run_jupyter|v1/ping)$")
_KEYED = re.compile(r"^/sf/([^/]+)(/.*)$")


def redact(path: str) -> str:
    """A path with any key in it replaced (for logs and error messages)."""
    m = _KEYED.match(path)
    return f"/sf/<key>{m.group(2)}" if m else ("/sf/<key>" if path.startswith(PREFIX) else path)


class PathKeyMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        key: str | None = None
        if path.startswith(PREFIX):
            m = _KEYED.match(path)
            if m is None or not SF_ROUTES.match(m.group(2)):
                await _not_found(send, redact(path))
                return
            key, path = m.group(1), m.group(2)
            scope["path"] = path
            scope["raw_path"] = path.encode()
        if SF_ROUTES.match(path) and b"api_key=" in scope.get("query_string", b""):
            query = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
            key = key or next((v for k, v in query if k == "api_key"), None)
            scope["query_string"] = urlencode([(k, v) for k, v in query if k != "api_key"]).encode()
        if key:
            # the key in the URL wins over any Authorization header
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"authorization"]
            headers.append((b"authorization", b"Bearer " + key.encode("latin-1", "replace")))
            scope["headers"] = headers
        await self.app(scope, receive, send)


async def _not_found(send: Send, path: str) -> None:
    body = json.dumps(NotFound(f"no route {path}", field="path",
                               fix="use http://HOST:PORT/sf/<api_key> as the base URL of a SandboxFusion "
                                   "client: it appends /run_code or /run_jupyter").to_body()).encode()
    await send({"type": "http.response.start", "status": 404,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
