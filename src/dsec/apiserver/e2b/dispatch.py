"""The ASGI application mounted at E2B_PREFIX: E2B REST, or a sandbox's traffic.

A request with the `E2b-Sandbox-Id` header (the e2b SDK sends it to E2B_SANDBOX_URL) is
sandbox traffic: its access token is checked here, before any body is read, then it goes to
envd (port 49983: Connect services and /files, /health) or to the port ingress (any other
`E2b-Sandbox-Port`). Every other request is the REST API, authenticated by the guard.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from dsec.apiserver.context import ApiContext
from dsec.apiserver.e2b.auth import TOKEN_HEADER, TRAFFIC_HEADER, AccessTokens
from dsec.apiserver.e2b.envd_common import ENVD_PORT, PORT_HEADER, Target, target_of
from dsec.apiserver.e2b.envd_files import TARGET_KEY
from dsec.apiserver.e2b.errors import NotImplementedE2B, e2b_response
from dsec.apiserver.guard import E2B_SANDBOX_HEADER, request_key
from dsec.types import DsecError, InvalidArgument, Unauthorized

log = logging.getLogger("dsec.apiserver.e2b")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class E2BDispatch:
    def __init__(self, ctx: ApiContext, tokens: AccessTokens, rest: ASGIApp, envd_http: ASGIApp,
                 rpc: dict[str, ASGIApp]):
        self.ctx = ctx
        self.tokens = tokens
        self.rest = rest
        self.envd_http = envd_http
        self.rpc = rpc                  # "/process.Process" -> its Connect application

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.rest(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if E2B_SANDBOX_HEADER not in headers:
            await self.rest(scope, receive, send)
            return
        try:
            port = _port(headers)
            t = await target_of(self.ctx, headers)
            self._authenticate(scope, headers, t, port)
        except DsecError as e:
            await _refuse(scope, receive, send, e)
            return
        scope.setdefault("state", {})[TARGET_KEY] = t
        if port != ENVD_PORT:
            await self._port(scope, receive, send, t, port)
            return
        path = _sub_path(scope)
        app = self.rpc.get("/" + path.lstrip("/").split("/", 1)[0]) or self.envd_http
        await app(scope, receive, send)

    def _authenticate(self, scope: Scope, headers: dict[str, str], t: Target, port: int) -> None:
        """envd: the sandbox's access token. Ports: that token, or an API key of its project."""
        if self.tokens.check(t.sandbox_id, headers.get(TOKEN_HEADER)):
            return
        if port == ENVD_PORT and scope["type"] == "http" and TOKEN_HEADER not in headers:
            why = self._signed_file_url(scope, t)
            if why is None:
                return
            if why:
                raise Unauthorized(f"{why} (sandbox {t.e2b_id})", field="signature",
                                   fix="ask the SDK for a new download_url/upload_url")
        if port != ENVD_PORT and self.tokens.check_traffic(t.sandbox_id, headers.get(TRAFFIC_HEADER)):
            return
        if port != ENVD_PORT and scope["type"] == "http":
            key = request_key(Request(scope))
            if key is not None:
                who = self.ctx.iam.authenticate(key)
                if self.ctx.iam.can_access(who, t.info.project):
                    return
        raise Unauthorized(f"missing or wrong access token for sandbox {t.e2b_id}", field="X-Access-Token",
                           fix="use the envdAccessToken of this sandbox (the SDK sends it when it created or "
                               "connected to the sandbox)")

    def _signed_file_url(self, scope: Scope, t: Target) -> str | None:
        """envd's signed file URLs (download_url/upload_url of a secured sandbox): GET /files
        reads, POST /files writes, as `username`, until `signature_expiration`. None: it holds;
        "": not a signed URL; else why it does not hold."""
        if _sub_path(scope).rstrip("/") != "/files" or scope.get("method") not in ("GET", "POST"):
            return ""
        q = Request(scope).query_params
        signature = q.get("signature")
        if not signature:
            return ""
        operation = "read" if scope["method"] == "GET" else "write"
        return self.tokens.check_signature(t.sandbox_id, q.get("path", ""), operation, q.get("username", ""),
                                           signature, q.get("signature_expiration"))

    async def _port(self, scope: Scope, receive: Receive, send: Send, t: Target, port: int) -> None:
        """Any port but envd's: dsec's port ingress (apiserver/ports.py), when it is there."""
        from dsec.apiserver import ports
        path = _sub_path(scope).lstrip("/")      # ports.py takes the path below "/" (query: from scope)
        if scope["type"] == "websocket":
            proxy_ws = getattr(ports, "proxy_websocket", None)
            if proxy_ws is None:
                await WebSocket(scope, receive, send).close(code=1011, reason="port ingress is not available")
                return
            await proxy_ws(WebSocket(scope, receive, send), t.edge, t.sandbox_id, port, path)
            return
        proxy_http = getattr(ports, "proxy_http", None)
        if proxy_http is None:
            # TODO(ports): served once apiserver/ports.py exports proxy_http/proxy_websocket
            await e2b_response(NotImplementedE2B(
                f"port {port}: port ingress is not available in this dsec build", field="E2b-Sandbox-Port",
                fix="only envd (port 49983) is served here"))(scope, receive, send)
            return
        try:
            response: Response = await proxy_http(Request(scope, receive), t.edge, t.sandbox_id, port, path)
        except DsecError as e:      # raised before the answer starts: nothing listens, no answer
            await e2b_response(e)(scope, receive, send)
            return
        await response(scope, receive, send)


def _port(headers: dict[str, str]) -> int:
    raw = headers.get(PORT_HEADER, str(ENVD_PORT))
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise InvalidArgument(f"E2b-Sandbox-Port {raw[:20]!r} is not a TCP port", field="E2b-Sandbox-Port",
                              fix="use 1..65535 (49983 is envd)")
    return int(raw)


def _sub_path(scope: Scope) -> str:
    """The request path below the mount (with the query string for port traffic)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def _refuse(scope: Scope, receive: Receive, send: Send, e: DsecError) -> None:
    if scope["type"] == "websocket":
        await WebSocket(scope, receive, send).close(code=1008, reason=e.message[:120])
        return
    headers = {"connection": "close"}      # the body is left unread
    await e2b_response(e, headers)(scope, receive, send)
