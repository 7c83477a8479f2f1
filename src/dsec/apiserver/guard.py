"""The apiserver's front door: authenticate before reading a body, and bound every body.

An ASGI middleware in front of the routes. A request without a valid key is answered 401
from its headers alone: its body is never read (and the connection is closed, so that a
300 MB upload is not even drained). An authenticated request's body is bounded per route:
a declared Content-Length over the limit is answered 413 at once, a chunked body is counted
as it arrives and refused when it passes the limit. Nothing here buffers a body.

Routes that work without a key: /healthz and the API's own documentation (openapi.json,
/docs, /redoc). SandboxFusion clients of /run_code send no Authorization header, so the
FnCall routes also take the key as ?api_key=... (fncall_routes.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request

from dsec.iam import Principal
from dsec.types import DsecError, InternalError, PayloadTooLarge, Unauthorized

log = logging.getLogger("dsec.apiserver")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MiB = 1024 * 1024
MAX_FILE_BYTES = 64 * MiB          # PUT .../files: one file per call
EXEC_BODY_BYTES = 24 * MiB         # ExecRequest: cmd (1 MiB) + stdin (16 MiB) + env, JSON-escaped
FNCALL_BODY_BYTES = 64 * MiB       # FnCallRequest: code, stdin, files, files_b64 (16 MiB each)
DEFAULT_BODY_BYTES = 1 * MiB       # every other route: sandbox args, policies, pack_diff


@dataclass(frozen=True)
class BodyLimit:
    method: str
    path: re.Pattern[str]
    max_bytes: int
    fix: str


# The first match wins; a route not listed gets DEFAULT_BODY_BYTES (the smallest limit).
BODY_LIMITS = (
    BodyLimit("PUT", re.compile(r"^/v1/sandboxes/[^/]+/files$"), MAX_FILE_BYTES,
              "split the file into parts of at most 64 MiB, or fetch or build it from inside the sandbox"),
    BodyLimit("POST", re.compile(r"^/v1/sandboxes/[^/]+/exec(/stream)?$"), EXEC_BODY_BYTES,
              "write large input to a file first (files.write) and redirect it into the command"),
    BodyLimit("POST", re.compile(r"^/(v1/fncall(/batch)?|run_code)$"), FNCALL_BODY_BYTES,
              "send fewer calls per batch, or smaller code, stdin and files per call"),
)
DEFAULT_FIX = "the JSON arguments of this route are small: send at most 1 MiB"

RUN_CODE_AUTH_FIX = ("SandboxFusion clients send no Authorization header: put the key in the URL, "
                     "e.g. http://HOST:7620/run_code?api_key=dsk_...")
QUERY_KEY_PATHS = re.compile(r"^/(v1/fncall(/.*)?|run_code)$")   # FnCall routes: ?api_key= too


def body_limit(method: str, path: str) -> tuple[int, str]:
    for lim in BODY_LIMITS:
        if lim.method == method and lim.path.match(path):
            return lim.max_bytes, lim.fix
    return DEFAULT_BODY_BYTES, DEFAULT_FIX


def request_key(request: Request) -> str | None:
    """The API key of a request: `Authorization: Bearer KEY`, or ?api_key=KEY on FnCall routes."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    if QUERY_KEY_PATHS.match(request.url.path):
        return request.query_params.get("api_key")
    return None


def principal_of(request: Request) -> Principal | None:
    """The principal the guard authenticated this request as (None: a public route)."""
    p = request.scope.get("state", {}).get("dsec_principal")
    return p if isinstance(p, Principal) else None


class BodyTooLarge(HTTPException):
    """Raised from receive() when a body passes its limit; the app answers it as 413."""

    def __init__(self, error: PayloadTooLarge):
        super().__init__(status_code=error.status, detail=error.message)
        self.error = error


def _too_large(method: str, path: str, limit: int, fix: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body larger than {limit} bytes ({limit // MiB} MiB), the limit of "
                           f"{method} {path}", field="body", fix=fix)


class RequestGuard:
    """ASGI middleware: authenticate (unless public), then bound the body. Also the catch-all
    for errors no route handled: a JSON 500 on a connection that stays usable."""

    def __init__(self, app: ASGIApp, *, authenticate: Callable[[str | None], Principal],
                 public_paths: frozenset[str]):
        self.app = app
        self.authenticate = authenticate
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        request = Request(scope)
        if path not in self.public_paths:
            try:
                principal = self.authenticate(request_key(request))
            except DsecError as e:
                if path == "/run_code" and isinstance(e, Unauthorized):
                    e = Unauthorized(e.message, field=e.field, fix=RUN_CODE_AUTH_FIX)
                await _reply(send, e)
                return
            scope.setdefault("state", {})["dsec_principal"] = principal
        limit, fix = body_limit(method, path)
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _reply(send, DsecError(f"bad Content-Length {declared[:40]!r}", field="content-length",
                                             fix="send the body's size in bytes, or a chunked body"))
                return
            if int(declared) > limit:
                await _reply(send, _too_large(method, path, limit, fix))
                return
        seen = 0

        async def bounded_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(_too_large(method, path, limit, fix))
            return message

        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except Exception as e:
            if started:   # a streamed answer broke off: the server closes the connection
                raise
            log.error("unhandled error", exc_info=e, extra={"method": method, "path": path})
            await _reply(send, InternalError(f"internal error ({type(e).__name__})",
                                             fix="retry; if it persists, report it with the server log"),
                         close=False)


async def _reply(send: Send, error: DsecError, close: bool = True) -> None:
    """Answer with the error body; close the connection when the request body is left unread."""
    body = json.dumps(error.to_body(), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    if isinstance(error, Unauthorized):
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
