"""The apiserver's front door: authenticate before reading a body, and bound every body.

An ASGI middleware in front of the routes. A request without a valid key is answered 401
from its headers alone: its body is never read (and the connection is closed, so that a
300 MB upload is not even drained). An authenticated request's body is bounded per route:
a declared Content-Length over the limit is answered 413 at once, a chunked body is counted
as it arrives and refused when it passes the limit. Nothing here buffers a body.

Routes that work without a key: /healthz and the API's own documentation (openapi.json,
/docs, /redoc). SandboxFusion clients of /run_code send no Authorization header, so the
FnCall routes also take the key as ?api_key=... (fncall_routes.py).

E2B routes (under E2B_PREFIX, apiserver/e2b/) take the key as `X-API-KEY` too, the header the
stock e2b SDK sends, and answer errors in E2B's shape `{"code", "message"}`. Their sandbox
traffic (envd and ports, marked by the `E2b-Sandbox-Id` header) carries no API key but the
sandbox's own access token: the E2B dispatcher checks that token before it reads a body, so the
guard only bounds those bodies.
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
from dsec.store.wait import waiting_at_most
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
IMAGE_BODY_BYTES = 16 * 1024 * MiB  # build context / image tar: the default of DSEC_IMAGE_UPLOAD_MAX_BYTES
IMAGE_PATHS = re.compile(r"^/v1/images/(build|import)$")
# E2B template builds: the tar of each COPY step (apiserver/e2b/templates.py), bounded as image uploads
E2B_TEMPLATE_FILES = re.compile(r"^/e2b/templates/[^/]+/files/[0-9a-f]{64}$")


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
    BodyLimit("POST", re.compile(r"^/v1/sandboxes/[^/]+/(exec(/stream)?|execs(/[0-9]+/stdin)?)$"), EXEC_BODY_BYTES,
              "write large input to a file first (files.write) and redirect it into the command"),
    BodyLimit("POST", re.compile(r"^/(v1/fncall(/batch)?|run_code|run_jupyter)$"), FNCALL_BODY_BYTES,
              "send fewer calls per batch, or smaller code, stdin and files per call"),
    BodyLimit("POST", IMAGE_PATHS, IMAGE_BODY_BYTES,
              "send a smaller build context (a .dockerignore'd copy) or image; or import on the node"),
    BodyLimit("PUT", E2B_TEMPLATE_FILES, IMAGE_BODY_BYTES,
              "copy fewer or smaller files per COPY step (.dockerignore what the template does not need)"),
    # E2B envd: file uploads, and stdin (one message, or a client stream over a command's life)
    BodyLimit("POST", re.compile(r"^/e2b/files$"), MAX_FILE_BYTES,
              "split the file into parts of at most 64 MiB, or fetch or build it from inside the sandbox"),
    # volume files (routes/volume_files.py, e2b/volume_content.py): one file per call
    BodyLimit("PUT", re.compile(r"^/(v1/volumes|e2b/volumecontent)/[^/]+/file$"), MAX_FILE_BYTES,
              "split the file into parts of at most 64 MiB, or write it through a sandbox that mounts the volume"),
    BodyLimit("POST", re.compile(r"^/e2b/process\.Process/(SendInput|StreamInput)$"), EXEC_BODY_BYTES,
              "write large input to a file first (files.write) and redirect it into the command"),
)
# Port ingress (apiserver/ports.py) streams bodies through without holding them: a large
# upload costs nothing, but every request stays bounded.
PORT_PATHS = re.compile(r"^/v1/sandboxes/[^/]+/ports/[0-9]+(/.*)?$")
PORT_FIX = "send at most 64 MiB per request to a sandbox's port"
DEFAULT_FIX = "the JSON arguments of this route are small: send at most 1 MiB"

RUN_CODE_AUTH_FIX = ("SandboxFusion clients send no Authorization header: put the key in the URL, "
                     "e.g. http://HOST:7620/run_code?api_key=dsk_...")
QUERY_KEY_PATHS = re.compile(r"^/(v1/fncall(/.*)?|run_code)$")   # FnCall routes: ?api_key= too

# E2B drop-in (apiserver/e2b/): its REST API and its sandbox traffic are served under this prefix
E2B_PREFIX = "/e2b"
E2B_SANDBOX_HEADER = "e2b-sandbox-id"     # sandbox traffic: authenticated by the E2B dispatcher
E2B_KEY_HEADER = "x-api-key"


def is_e2b_path(path: str) -> bool:
    return path == E2B_PREFIX or path.startswith(E2B_PREFIX + "/")


def is_e2b_volume_content(path: str) -> bool:
    """E2B's volume content API: authenticated by the volume's token (e2b/volume_content.py)."""
    return path.startswith(E2B_PREFIX + "/volumecontent/")


def is_e2b_sandbox_traffic(request: Request) -> bool:
    """envd and port requests of the e2b SDK: the dispatcher checks the sandbox's access token."""
    return is_e2b_path(request.url.path) and E2B_SANDBOX_HEADER in request.headers


def body_limit(method: str, path: str, image_bytes: int = IMAGE_BODY_BYTES) -> tuple[int, str]:
    if PORT_PATHS.match(path):
        return MAX_FILE_BYTES, PORT_FIX
    for lim in BODY_LIMITS:
        if lim.method == method and lim.path.match(path):
            return image_bytes if lim.path in (IMAGE_PATHS, E2B_TEMPLATE_FILES) else lim.max_bytes, lim.fix
    return DEFAULT_BODY_BYTES, DEFAULT_FIX


def request_key(request: Request) -> str | None:
    """The API key of a request: `Authorization: Bearer KEY`, ?api_key=KEY on FnCall routes,
    `X-API-KEY: KEY` on E2B routes."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    if is_e2b_path(request.url.path) and E2B_KEY_HEADER in request.headers:
        return request.headers[E2B_KEY_HEADER].strip()
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
                 public_paths: frozenset[str], image_body_bytes: int = IMAGE_BODY_BYTES,
                 store_wait_s: float | None = None):
        self.app = app
        self.store_wait_s = store_wait_s             # DSEC_DB_REQUEST_WAIT_S (store/wait.py)
        self.image_body_bytes = image_body_bytes     # DSEC_IMAGE_UPLOAD_MAX_BYTES
        self.authenticate = authenticate
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":     # start-up and shut-down work: the store's own retry window
            await self.app(scope, receive, send)
            return
        # every database call of this request (and its threads) waits at most that for the store
        with waiting_at_most(self.store_wait_s):
            await self._guarded(scope, receive, send)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        request = Request(scope)
        e2b = is_e2b_path(path)
        if path not in self.public_paths and not is_e2b_sandbox_traffic(request) and not is_e2b_volume_content(path):
            try:
                principal = self.authenticate(request_key(request))
            except DsecError as e:
                if path == "/run_code" and isinstance(e, Unauthorized):
                    e = Unauthorized(e.message, field=e.field, fix=RUN_CODE_AUTH_FIX)
                if e2b and isinstance(e, Unauthorized):
                    e = Unauthorized(e.message, field="X-API-KEY", fix="set E2B_API_KEY to a dsec API key (dsk_...)")
                await _reply(send, e, e2b=e2b)
                return
            scope.setdefault("state", {})["dsec_principal"] = principal
        limit, fix = body_limit(method, path, self.image_body_bytes)
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _reply(send, DsecError(f"bad Content-Length {declared[:40]!r}", field="content-length",
                                             fix="send the body's size in bytes, or a chunked body"), e2b=e2b)
                return
            if int(declared) > limit:
                await _reply(send, _too_large(method, path, limit, fix), e2b=e2b)
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
                         close=False, e2b=e2b)


def e2b_error_body(error: DsecError) -> dict[str, Any]:
    """An error in E2B's shape: `code` is the HTTP status (the e2b SDK reads `message`); the
    field and the fix are part of the message, since E2B has no place for them."""
    status = 400 if error.status == 422 else error.status   # E2B answers bad arguments with 400
    parts = [error.message]
    if error.field and error.field not in error.message:
        parts.append(f"field: {error.field}")
    if error.fix:
        parts.append(f"fix: {error.fix}")
    return {"code": status, "message": "; ".join(parts)}


async def _reply(send: Send, error: DsecError, close: bool = True, e2b: bool = False) -> None:
    """Answer with the error body; close the connection when the request body is left unread."""
    content = e2b_error_body(error) if e2b else error.to_body()
    status = content["code"] if e2b else error.status
    body = json.dumps(content, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    if isinstance(error, Unauthorized):
        headers.append((b"www-authenticate", b"Bearer"))
    retry = getattr(error, "retry_after_s", None)
    if retry:       # the control store is down (store/db.py): when to try again
        headers.append((b"retry-after", str(retry).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
