"""Port ingress: HTTP and WebSocket to a TCP port inside a sandbox, through the apiserver.

    /v1/sandboxes/{id}/ports/{port}/{path}   any method, or a WebSocket upgrade

The caller authenticates with its API key like on every other route and must own the sandbox;
the connection into the sandbox comes from the edge (`EdgeHandle.port_connection`: for
containers a socket made in the sandbox's network namespace, so its loopback-only servers are
reachable and its egress policy does not apply to that socket).

The server inside the sandbox is untrusted. What it can make the apiserver hold is bounded:
its response head at most MAX_HEAD_BYTES (h11 refuses more: 502), the first byte of its answer
within HEAD_TIMEOUT_S (504), bodies and WebSocket data relayed in READ_BYTES pieces with
back-pressure (nothing is read from the sandbox before the caller took the previous piece),
one WebSocket message at most MAX_WS_MESSAGE_BYTES (1009). A streamed response may last as
long as the caller reads it; the connection ends when either side goes.

The sandbox never sees the caller's API key (Authorization and X-API-KEY are dropped), nor
hop-by-hop headers; it gets Host: localhost:PORT and X-Forwarded-For/-Proto/-Host/-Prefix.
Each request gets its own connection (Connection: close).

`proxy_http` and `proxy_websocket` are reused by the E2B routes (apiserver/e2b/), which do
their own authentication.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import AsyncExitStack
from typing import Annotated, Any
from urllib.parse import quote

import h11
from fastapi import FastAPI, Request, WebSocket
from fastapi import Path as PathParam
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocketDisconnect, WebSocketState

from dsec.apiserver.deps import Who
from dsec.apiserver.control import owned_edge
from dsec.apiserver.context import ApiContext, EdgeHandle
from dsec.iam import Principal
from dsec.types import BadGateway, DsecError, GatewayTimeout, InvalidArgument, Unauthorized

try:   # the [server] extra's WebSocket library (uvicorn needs one to serve WebSockets at all)
    from wsproto import ConnectionType, WSConnection
    from wsproto.connection import ConnectionState
    from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Ping, RejectConnection,
                                RejectData, TextMessage)
    from wsproto.events import Request as WsRequest
    from wsproto.utilities import LocalProtocolError, RemoteProtocolError
    HAVE_WSPROTO = True
except ImportError:     # HTTP ingress still works; WebSocket routes are not registered
    HAVE_WSPROTO = False

log = logging.getLogger("dsec.apiserver.ports")

PORT_PATH = "/v1/sandboxes/{sandbox_id}/ports/{port}"
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

MAX_HEAD_BYTES = 64 * 1024          # the sandbox's response head (status line + headers)
HEAD_TIMEOUT_S = 60.0               # from the request sent to the response head (or WS handshake)
READ_BYTES = 64 * 1024              # one piece read from the sandbox
MAX_WS_MESSAGE_BYTES = 16 * 1024 * 1024   # one WebSocket message from the sandbox (uvicorn's own limit the other way)

# Never forwarded either way: hop-by-hop headers (RFC 9110 7.6.1) and what the proxy sets.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                        b"upgrade", b"proxy-authenticate", b"proxy-authorization"})
# Never forwarded to the sandbox: dsec's API keys, and what the proxy sets itself.
# The caller's credentials stay here: an API key, and the E2B access tokens (envd's and the
# traffic token), which a server in the sandbox could otherwise replay against its own envd.
REQUEST_DROPPED = frozenset({b"authorization", b"x-api-key", b"host", b"expect", b"forwarded",
                             b"x-access-token", b"e2b-traffic-access-token"})
# Not passed back from the sandbox: the apiserver (uvicorn) sets its own.
RESPONSE_DROPPED = frozenset({b"date", b"server"})


class UpstreamBroken(Exception):
    """The sandbox's response broke off after its head was relayed: the caller's connection
    is aborted (a clean end would pass a truncated body as complete)."""


# -- shared ----------------------------------------------------------------------------------
def _connection_tokens(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    """Header names listed in Connection: hop-by-hop too."""
    return {t.strip().lower() for k, v in headers if k.lower() == b"connection" for t in v.split(b",") if t.strip()}


def _target(path: str, query: bytes) -> str:
    """The request target inside the sandbox: the route's (decoded) path, re-quoted, and the
    caller's query string as it came."""
    target = "/" + quote(path.lstrip("/"), safe="/:@!$&'()*+,;=-._~")
    return target + ("?" + query.decode("latin-1") if query else "")


def _prefix(url_path: str, path: str) -> str:
    """The part of the caller's path before the forwarded one (X-Forwarded-Prefix)."""
    tail = "/" + path.lstrip("/") if path else ""
    base = url_path[: len(url_path) - len(tail)] if tail and url_path.endswith(tail) else url_path
    return base.rstrip("/")


def _forwarded(name: bytes, named: set[bytes], websocket: bool) -> bool:
    return (name not in HOP_BY_HOP and name not in REQUEST_DROPPED and name not in named
            and not name.startswith(b"x-forwarded-") and not (websocket and name.startswith(b"sec-websocket-")))


def _forward_headers(conn: Request | WebSocket, port: int, path: str) -> list[tuple[bytes, bytes]]:
    """The caller's headers as the sandbox gets them: no API key, no hop-by-hop headers, no
    X-Forwarded-* of the caller's own (nor its Sec-WebSocket-*: the proxy's own handshake has
    them); Host and X-Forwarded-* set by the proxy."""
    raw = list(conn.headers.raw)
    named = _connection_tokens(raw)
    websocket = isinstance(conn, WebSocket)
    out = [(k.lower(), v) for k, v in raw if _forwarded(k.lower(), named, websocket)]
    client = conn.client.host if conn.client else ""
    scheme = {"ws": "http", "wss": "https"}.get(conn.url.scheme, conn.url.scheme)
    out += [(b"host", f"localhost:{port}".encode()), (b"x-forwarded-for", client.encode()),
            (b"x-forwarded-proto", scheme.encode()),
            (b"x-forwarded-host", conn.headers.get("host", "").encode("latin-1")),
            (b"x-forwarded-prefix", quote(_prefix(conn.url.path, path), safe="/").encode())]
    return out


# -- HTTP ------------------------------------------------------------------------------------
async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    """The next h11 event from the sandbox, reading READ_BYTES at a time (b"" = its EOF)."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(READ_BYTES))


async def _read_head(conn: h11.Connection, reader: asyncio.StreamReader, where: str) -> h11.Response:
    """The sandbox's final response head (1xx interim responses are skipped)."""
    try:
        while True:
            event = await _next_event(conn, reader)
            if isinstance(event, h11.Response):
                return event
            if isinstance(event, h11.ConnectionClosed):
                raise BadGateway(f"{where} closed the connection without an HTTP response", field="port",
                                 fix="check that the server on this port speaks HTTP/1.1")
            # h11.InformationalResponse (100 Continue, 103 Early Hints): wait for the final one
    except h11.RemoteProtocolError as e:
        raise BadGateway(f"{where} sent an invalid or too large response head ({e}; at most {MAX_HEAD_BYTES} "
                         "bytes of headers)", field="port",
                         fix="check that the server on this port speaks HTTP/1.1") from None


def _request_framing(request: Request, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request has a body; a chunked one is forwarded chunked (Content-Length is
    kept as it came: the body is forwarded byte for byte)."""
    if "transfer-encoding" in request.headers:
        headers[:] = [(k, v) for k, v in headers if k != b"content-length"]
        headers.append((b"transfer-encoding", b"chunked"))
        return True
    return int(request.headers.get("content-length", "0") or 0) > 0


async def _send_body(request: Request, conn: h11.Connection, writer: asyncio.StreamWriter, has_body: bool) -> None:
    """Stream the caller's body to the sandbox, a chunk at a time, waiting for the sandbox to
    take each (drain)."""
    if has_body:
        async for chunk in request.stream():
            if chunk:
                writer.write(conn.send(h11.Data(data=chunk)))
                await writer.drain()
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()


async def _exchange(request: Request, conn: h11.Connection, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter, has_body: bool, where: str) -> h11.Response:
    """Send the body while waiting for the response head. A head that comes first ends the
    upload (the server answered without reading it all, e.g. a 413); the head must come within
    HEAD_TIMEOUT_S of the body's end."""
    head = asyncio.ensure_future(_read_head(conn, reader, where))
    upload = asyncio.ensure_future(_send_body(request, conn, writer, has_body))
    try:
        await asyncio.wait({head, upload}, return_when=asyncio.FIRST_COMPLETED)
        if upload.done() and not head.done():
            upload.result()          # the caller's body failed (too large, caller gone): raise it
        try:
            return await asyncio.wait_for(asyncio.shield(head), HEAD_TIMEOUT_S)
        except TimeoutError:
            raise GatewayTimeout(f"{where} sent no response within {HEAD_TIMEOUT_S:g} s", field="port",
                                 fix="the server may be busy or hung; retry, or check it in the sandbox") from None
    finally:
        for task in (head, upload):
            if not task.done():
                task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(head, upload, return_exceptions=True)


class _Relay(Response):
    """The sandbox's response, relayed as it is read: one piece at a time, the next read only
    once the caller's connection took the previous one. Ends (and frees the connection into
    the sandbox) when the body ends, the caller goes away, or the sandbox breaks off."""

    def __init__(self, head: h11.Response, conn: h11.Connection, reader: asyncio.StreamReader,
                 stack: AsyncExitStack, where: str):
        named = _connection_tokens(list(head.headers))
        self.status_code = head.status_code
        self.raw_headers = [(k, v) for k, v in head.headers
                            if k not in HOP_BY_HOP and k not in named and k not in RESPONSE_DROPPED]
        self.background = None
        self._conn, self._reader, self._stack, self._where = conn, reader, stack, where

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(send))
            gone = asyncio.ensure_future(_caller_gone(receive))
            try:
                await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, gone):
                    task.cancel()
                await asyncio.gather(pump, gone, return_exceptions=True)
            if not pump.cancelled() and pump.exception() is not None:
                raise pump.exception()   # type: ignore[misc]
        finally:
            await self._stack.aclose()

    async def _pump(self, send: Send) -> None:
        while True:
            try:
                event = await _next_event(self._conn, self._reader)
            except h11.RemoteProtocolError as e:
                raise UpstreamBroken(f"{self._where}: invalid response body ({e})") from None
            if isinstance(event, h11.Data):
                await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
            elif isinstance(event, h11.EndOfMessage):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise UpstreamBroken(f"{self._where} closed the connection mid-response")


async def _caller_gone(receive: Receive) -> None:
    """Returns when the caller disconnects (what is left of a request body is discarded). If
    receive() fails, the caller cannot be watched: waits forever (the pump ends the relay)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:
        await asyncio.Event().wait()


async def proxy_http(request: Request, edge: EdgeHandle, sandbox_id: str, port: int, path: str) -> Response:
    """Forward `request` to http://localhost:`port`/`path` inside the sandbox and stream the
    answer back. The caller authenticated the request and checked access to the sandbox.
    Raises DsecError before the response starts: 503 nothing listens on the port (or the
    sandbox is not running), 502 invalid answer, 504 no answer within HEAD_TIMEOUT_S."""
    where = f"the server on port {port} in sandbox {sandbox_id}"
    headers = _forward_headers(request, port, path) + [(b"connection", b"close")]
    has_body = _request_framing(request, headers)
    stack = AsyncExitStack()
    try:
        reader, writer = await stack.enter_async_context(edge.port_connection(sandbox_id, port))
        conn = h11.Connection(our_role=h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            head_bytes = conn.send(h11.Request(method=request.method, headers=headers,
                                               target=_target(path, request.scope["query_string"])))
        except h11.LocalProtocolError as e:     # a target or header h11 will not send
            raise InvalidArgument(f"cannot forward this request: {e}", field="path",
                                  fix="use plain ASCII in the path, query and headers") from None
        writer.write(head_bytes or b"")
        head = await _exchange(request, conn, reader, writer, has_body, where)
        return _Relay(head, conn, reader, stack, where)
    except BaseException:
        await stack.aclose()
        raise


# -- WebSocket -------------------------------------------------------------------------------
WS_POLICY = 1008          # refused: no key, not the caller's sandbox, bad port
WS_TOO_BIG = 1009
WS_ERROR = 1011           # the sandbox's side failed
_NOT_SENDABLE = {1004, 1005, 1006, 1015}   # reserved: never in a close frame
SERVER_FIX = "pip install 'dsec-sandbox[server]' (wsproto)"


def _close_code(code: int | None) -> int:
    if code is None or code in _NOT_SENDABLE or not (1000 <= code <= 1014 or 3000 <= code <= 4999):
        return 1000
    return code


def _reason(text: str) -> str:
    """A close reason fits in 123 bytes of UTF-8."""
    data = text.encode()
    return text if len(data) <= 123 else data[:120].decode(errors="ignore") + "..."


async def _ws_close(websocket: WebSocket, code: int, reason: str) -> None:
    """Close the caller's WebSocket with a code and reason, accepting it first if needed (a
    close before accept would be a bare HTTP 403 without the reason)."""
    with contextlib.suppress(Exception):   # the caller may be gone already
        if websocket.application_state == WebSocketState.CONNECTING:
            await websocket.accept()
        if websocket.application_state == WebSocketState.CONNECTED:
            await websocket.close(code, _reason(reason))


async def _ws_handshake(websocket: WebSocket, port: int, path: str, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, where: str) -> tuple[WSConnection, str | None]:
    """Open the WebSocket to the sandbox's server: the caller's subprotocols and (filtered)
    headers go along; returns the connection and the subprotocol the server chose."""
    ws = WSConnection(ConnectionType.CLIENT)
    headers = [(k, v) for k, v in _forward_headers(websocket, port, path) if k != b"host"]   # wsproto sets Host
    writer.write(ws.send(WsRequest(host=f"localhost:{port}", target=_target(path, websocket.scope["query_string"]),
                                   subprotocols=list(websocket.scope.get("subprotocols", [])),
                                   extra_headers=headers)))
    await writer.drain()
    while True:
        data = await reader.read(READ_BYTES)
        try:
            ws.receive_data(data or None)
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    return ws, event.subprotocol
                if isinstance(event, (RejectConnection, RejectData)):
                    status = getattr(event, "status_code", "?")
                    raise BadGateway(f"{where} refused the WebSocket upgrade (HTTP {status})", field="path",
                                     fix="check the path and that the server accepts WebSockets there")
        except RemoteProtocolError as e:
            raise BadGateway(f"{where} sent an invalid WebSocket handshake ({e})", field="port") from None
        if not data:
            raise BadGateway(f"{where} closed the connection during the WebSocket handshake", field="port")


async def _caller_to_sandbox(websocket: WebSocket, ws: WSConnection, writer: asyncio.StreamWriter) -> None:
    """The caller's messages to the sandbox (with back-pressure); its close, passed on."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            if ws.state == ConnectionState.OPEN:
                code = _close_code(message.get("code"))
                writer.write(ws.send(CloseConnection(code=code, reason=_reason(message.get("reason") or ""))))
                await writer.drain()
            return
        if message.get("text") is not None:
            writer.write(ws.send(TextMessage(data=message["text"])))
        elif message.get("bytes") is not None:
            writer.write(ws.send(BytesMessage(data=message["bytes"])))
        await writer.drain()


async def _sandbox_to_caller(websocket: WebSocket, ws: WSConnection, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter, where: str) -> None:
    """The sandbox's messages to the caller, each assembled (ASGI sends whole messages) up to
    MAX_WS_MESSAGE_BYTES; pings answered; its close passed on with its code and reason."""
    parts: list[Any] = []
    size = 0
    data: bytes | None = b"-"     # the handshake may have left events: look at them first
    while True:
        for event in ws.events():
            if isinstance(event, (TextMessage, BytesMessage)):
                parts.append(event.data)
                size += len(event.data)      # bytes, or characters of a text message
                if size > MAX_WS_MESSAGE_BYTES:
                    reason = f"message from the sandbox larger than {MAX_WS_MESSAGE_BYTES} bytes"
                    with contextlib.suppress(LocalProtocolError):
                        writer.write(ws.send(CloseConnection(code=WS_TOO_BIG, reason=reason)))
                    await _ws_close(websocket, WS_TOO_BIG, reason)
                    return
                if event.message_finished:
                    if isinstance(event, TextMessage):
                        await websocket.send_text("".join(parts))
                    else:
                        await websocket.send_bytes(b"".join(parts))
                    parts, size = [], 0
            elif isinstance(event, Ping):
                writer.write(ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                if ws.state == ConnectionState.REMOTE_CLOSING:
                    writer.write(ws.send(event.response()))
                await _ws_close(websocket, _close_code(event.code), event.reason or "")
                return
        await writer.drain()
        if not data:
            await _ws_close(websocket, WS_ERROR, f"{where} closed the connection without a close frame")
            return
        data = await reader.read(READ_BYTES)
        try:
            ws.receive_data(data or None)
        except RemoteProtocolError as e:
            await _ws_close(websocket, WS_ERROR, f"invalid WebSocket data from the sandbox ({e})")
            return


async def _relay(websocket: WebSocket, ws: WSConnection, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, where: str) -> None:
    """Both directions at once, until either side closes."""
    up = asyncio.ensure_future(_caller_to_sandbox(websocket, ws, writer))
    down = asyncio.ensure_future(_sandbox_to_caller(websocket, ws, reader, writer, where))
    try:
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (up, down):
            task.cancel()
        results = await asyncio.gather(up, down, return_exceptions=True)
    # a side that ended normally closed the other already (the caller's close went to the
    # sandbox, the sandbox's to the caller); one that failed leaves the caller to be told
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, (WebSocketDisconnect, asyncio.CancelledError)):
            log.info("port ingress WebSocket relay ended by an error", exc_info=r, extra={"where": where})
            await _ws_close(websocket, WS_ERROR, f"connection to the sandbox's server failed ({type(r).__name__})")
            return


async def proxy_websocket(websocket: WebSocket, edge: EdgeHandle, sandbox_id: str, port: int, path: str) -> None:
    """Relay the (not yet accepted) `websocket` to a WebSocket server on `port`/`path` inside
    the sandbox: accepted with the subprotocol that server chose, text and binary messages
    both ways, close codes passed on. The caller authenticated it and checked access. Errors
    close it with a reason: 1008 for refusals (4xx), 1011 when the sandbox's side fails."""
    where = f"the server on port {port} in sandbox {sandbox_id}"
    if not HAVE_WSPROTO:
        await _ws_close(websocket, WS_ERROR, "this server has no WebSocket support (install wsproto)")
        return
    try:
        async with edge.port_connection(sandbox_id, port) as (reader, writer):
            try:
                ws, subprotocol = await asyncio.wait_for(
                    _ws_handshake(websocket, port, path, reader, writer, where), HEAD_TIMEOUT_S)
            except TimeoutError:
                raise GatewayTimeout(f"{where} did not complete the WebSocket handshake within "
                                     f"{HEAD_TIMEOUT_S:g} s", field="port") from None
            await websocket.accept(subprotocol=subprotocol)
            await _relay(websocket, ws, reader, writer, where)
    except DsecError as e:
        await _ws_close(websocket, WS_POLICY if e.status < 500 else WS_ERROR, e.message)
    except (OSError, RemoteProtocolError, LocalProtocolError) as e:   # the sandbox's side broke off
        await _ws_close(websocket, WS_ERROR, f"connection to {where} failed ({type(e).__name__})")


# -- routes ----------------------------------------------------------------------------------
Port = Annotated[int, PathParam(ge=1, le=65535, description="a TCP port inside the sandbox")]


def _ws_principal(ctx: ApiContext, websocket: WebSocket) -> Principal:
    """The guard only looks at HTTP requests: a WebSocket's key (Authorization: Bearer) is
    checked here."""
    auth = websocket.headers.get("authorization", "")
    if not auth.lower().startswith("bearer "):
        raise Unauthorized("no API key: send Authorization: Bearer <key> with the WebSocket upgrade",
                           field="Authorization", fix="set the Authorization header to 'Bearer dsk_...'")
    return ctx.iam.authenticate(auth[7:].strip())


def add_port_routes(app: FastAPI, ctx: ApiContext) -> None:
    """HTTP (any method) and WebSocket at /v1/sandboxes/{id}/ports/{port}/{path}. Left out of
    the OpenAPI schema: what they answer is whatever the sandbox's server answers."""

    @app.api_route(PORT_PATH + "/{path:path}", methods=METHODS, include_in_schema=False)
    async def port_http(sandbox_id: str, port: Port, path: str, request: Request, who: Who) -> Response:
        edge = await owned_edge(ctx, sandbox_id, who)
        return await proxy_http(request, edge, sandbox_id, port, path)

    @app.api_route(PORT_PATH, methods=METHODS, include_in_schema=False)
    async def port_http_root(sandbox_id: str, port: Port, request: Request, who: Who) -> Response:
        edge = await owned_edge(ctx, sandbox_id, who)
        return await proxy_http(request, edge, sandbox_id, port, "")

    async def port_ws(websocket: WebSocket, sandbox_id: str, port: int, path: str) -> None:
        try:
            if not 0 < port < 65536:
                raise DsecError(f"port {port} is not a TCP port", field="port", fix="use 1..65535")
            edge = await owned_edge(ctx, sandbox_id, _ws_principal(ctx, websocket))
        except DsecError as e:
            await _ws_close(websocket, WS_POLICY if e.status < 500 else WS_ERROR, e.message)
            return
        await proxy_websocket(websocket, edge, sandbox_id, port, path)

    async def port_ws_root(websocket: WebSocket, sandbox_id: str, port: int) -> None:
        await port_ws(websocket, sandbox_id, port, "")

    if HAVE_WSPROTO:
        app.add_api_websocket_route(PORT_PATH + "/{path:path}", port_ws)
        app.add_api_websocket_route(PORT_PATH, port_ws_root)
    else:
        log.warning("wsproto is not installed: port ingress serves no WebSocket", extra={"fix": SERVER_FIX})


__all__ = ["add_port_routes", "proxy_http", "proxy_websocket"]
