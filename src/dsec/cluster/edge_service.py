"""One node's edge (and its FnCall service) over HTTP, for the apiserver replicas of a cluster.

Every EdgeHandle method is `POST /v1/edge/<method>` (wire.py derives the bodies from the
protocol), port_connection a WebSocket tunnel at /v1/tunnel. Every request, the tunnel
included, must carry `Authorization: Bearer <cluster secret>` (compared in constant time);
anything else is a 401 before a body is read. The service binds to the node's cluster address,
never to a sandbox bridge; sandboxes cannot reach the host at all (the bridge's nft input drop,
network.py), and one that could would still lack the secret (tests/test_cluster_http.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from dsec import tracing
from dsec.apiserver.context import EdgeHandle, FnCallHandle
from dsec.cluster.wire import (AUTH_HEADER, EDGE_PREFIX, FNCALL_PREFIX, TUNNEL_EOF, TUNNEL_OK, TUNNEL_PATH,
                               MethodSpec, error_body, specs)
from dsec.types import DsecError, InternalError, InvalidArgument, NotFound, Unauthorized, Unavailable

log = logging.getLogger("dsec.cluster.edge_service")

EDGE_SPECS = specs(EdgeHandle)
FNCALL_SPECS = specs(FnCallHandle)
TUNNEL_CHUNK = 64 * 1024


Secrets = Callable[[], list[str]]     # the accepted secrets now (secret_file.SecretFile.accepted)


def _authorized(headers: Any, secrets: Secrets) -> bool:
    given = headers.get(AUTH_HEADER, "")
    scheme, _, token = given.partition(" ")
    # constant time: the comparison says nothing about how much of the secret a guess got right
    # (every accepted one compared: during a rotation there are two)
    ok = [hmac.compare_digest(token.encode(), s.encode()) for s in secrets()]
    return scheme.lower() == "bearer" and any(ok)


def _error(e: DsecError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status)


async def _ndjson(events: AsyncIterator[Any], spec: MethodSpec) -> AsyncIterator[bytes]:
    try:
        async for ev in events:
            yield spec.result(result=ev).model_dump_json().encode() + b"\n"
    except DsecError as e:
        yield json.dumps(error_body(e)).encode() + b"\n"
    except Exception as e:
        log.error("edge stream failed", exc_info=e, extra={"method": spec.name})
        yield json.dumps(error_body(InternalError(f"internal error in the edge ({type(e).__name__})"))).encode() + b"\n"
    finally:
        # the caller went away (or the stream ended): release what the edge holds for it now
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _rpc(target: object, table: dict[str, MethodSpec], secret: Secrets):
    async def handle(request: Request) -> Response:
        try:
            authorized = _authorized(request.headers, secret)
        except DsecError as e:     # the node's secret file missing or empty: say so, never a 500
            return _error(e)
        if not authorized:
            return _error(Unauthorized("the edge service needs the cluster secret", field="authorization",
                                       fix="call it from an apiserver of this cluster"))
        name = request.path_params["method"]
        spec = table.get(name)
        if spec is None or spec.kind == "tunnel":
            return _error(NotFound(f"no edge method {name!r}", field="method"))
        try:
            args = spec.params.model_validate_json(await request.body())
        except ValidationError as e:
            errs = e.errors()
            field = ".".join(str(p) for p in errs[0]["loc"]) if errs else "body"
            msg = errs[0]["msg"] if errs else "invalid"
            return _error(InvalidArgument(f"{name}: {field}: {msg}", field=field,
                                          fix="apiserver and edge must run the same dsec version"))
        kwargs = {f: getattr(args, f) for f in spec.params.model_fields}
        fn = getattr(target, name)
        try:
            if spec.kind == "stream":
                items = fn(**kwargs)
                if tracing.on():     # the stream in one server span, continuing the apiserver's trace
                    items = tracing.traced(f"dsec.edge/{name}", items, "server", parent=tracing.extract(request.headers))
                return StreamingResponse(_ndjson(items, spec), media_type="application/x-ndjson")
            if tracing.on():     # continue the apiserver's trace (its traceparent)
                with tracing.span(f"dsec.edge/{name}", "server", parent=tracing.extract(request.headers)):
                    result = await fn(**kwargs)
            else:
                result = await fn(**kwargs)
        except DsecError as e:
            return _error(e)
        except Exception as e:   # a bug: logged here, an InternalError there
            log.error("edge call failed", exc_info=e, extra={"method": name})
            return _error(InternalError(f"internal error in the edge ({type(e).__name__})",
                                        fix="retry; if it persists, report it with the edge's log"))
        if spec.kind == "bytes":
            return Response(result, media_type="application/octet-stream")
        return Response(spec.result(result=result).model_dump_json(), media_type="application/json")

    return handle


async def _pump_in(ws: WebSocket, writer: asyncio.StreamWriter) -> None:
    """Caller -> sandbox: binary frames are data, TUNNEL_EOF half-closes."""
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return
        if msg.get("bytes") is not None:
            writer.write(msg["bytes"])
            await writer.drain()
        elif msg.get("text") == TUNNEL_EOF and writer.can_write_eof():
            writer.write_eof()


async def _pump_out(reader: asyncio.StreamReader, ws: WebSocket) -> None:
    while data := await reader.read(TUNNEL_CHUNK):
        await ws.send_bytes(data)


def _tunnel(edge: EdgeHandle, secret: Secrets):
    async def handle(ws: WebSocket) -> None:
        try:
            authorized = _authorized(ws.headers, secret)
        except DsecError:
            authorized = False
        if not authorized:
            await ws.close(code=1008)     # before accept: the handshake is refused (HTTP 403)
            return
        await ws.accept()
        try:
            sandbox_id = ws.query_params.get("sandbox_id", "")
            port = int(ws.query_params.get("port", "0"))
        except ValueError:
            await ws.send_text(json.dumps(error_body(InvalidArgument("port is not a number", field="port"))))
            await ws.close()
            return
        opened = False
        err: DsecError | None = None
        try:
            async with edge.port_connection(sandbox_id, port) as (reader, writer):
                opened = True
                await ws.send_text(TUNNEL_OK)
                pumps = [asyncio.create_task(_pump_in(ws, writer)), asyncio.create_task(_pump_out(reader, ws))]
                try:
                    # either direction ending ends the tunnel (the sandbox closed, or the caller did)
                    await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in pumps:
                        t.cancel()
                    await asyncio.gather(*pumps, return_exceptions=True)
        except WebSocketDisconnect:
            err = None
        except DsecError as e:
            err = e
        except OSError as e:     # the sandbox's side failed (its netns gone mid-open, a reset)
            err = Unavailable(f"connection to port {port} in sandbox {sandbox_id} failed: {e}", field="port")
        except Exception as e:
            log.error("edge tunnel failed", exc_info=e)
            err = InternalError(f"internal error in the edge ({type(e).__name__})")
        if err is not None and not opened:
            try:
                await ws.send_text(json.dumps(error_body(err)))
            except (RuntimeError, WebSocketDisconnect):
                pass
        try:
            await ws.close()
        except RuntimeError:   # already closed by the caller
            pass

    return handle


def edge_app(edge: EdgeHandle, secret: str | Secrets, fncall: FnCallHandle | None = None) -> Starlette:
    """`secret`: the one secret callers must send, or what gives the accepted ones at each call
    (a node's secret file: rotatable without a restart)."""
    if isinstance(secret, str):
        if len(secret) < 32:
            raise InvalidArgument("the cluster secret is too short", field="secret",
                                  fix="use `dsec cluster up`, which generates one (secrets.token_urlsafe(32))")
        fixed = [secret]
        secret = lambda: fixed     # noqa: E731
    routes = [Route(EDGE_PREFIX + "{method}", _rpc(edge, EDGE_SPECS, secret), methods=["POST"]),
              WebSocketRoute(TUNNEL_PATH, _tunnel(edge, secret))]
    if fncall is not None:
        routes.append(Route(FNCALL_PREFIX + "{method}", _rpc(fncall, FNCALL_SPECS, secret), methods=["POST"]))
    return Starlette(routes=routes)


def bind(host: str, port: int = 0, reuse_port: bool = False) -> socket.socket:
    """The service's listening socket (port 0: any free one; several edges may share a host).
    reuse_port: replicas on one host share one API port (the kernel spreads connections)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield        # the hosting process (a Ray worker, `dsec up`, a test) owns its signals


async def serve(app: Starlette, sock: socket.socket, tls_file: str | None = None) -> uvicorn.Server:
    """Start serving `app` on `sock` in this event loop; returns the running server (its
    `should_exit = True` stops it). `tls_file`: key + certificate chain in one PEM: TLS only
    (a plain HTTP request fails its handshake and is never read)."""
    # h11 by name: "auto" would pick httptools (installed with the server extra), which bounds no
    # request head; the apiserver's guarded httptools protocol also caps connections per address,
    # which the apiserver's own many connections to this edge must not meet
    config = uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=2,
                            ws_max_size=1 << 20, timeout_keep_alive=30, ssl_certfile=tls_file, http="h11")
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="edge-service")
    while not server.started:
        if task.done():
            task.result()      # raises what stopped it
        await asyncio.sleep(0.02)
    server._dsec_task = task   # type: ignore[attr-defined]
    return server


async def stop(server: uvicorn.Server) -> None:
    server.should_exit = True
    task = getattr(server, "_dsec_task", None)
    if task is not None:
        await asyncio.gather(task, return_exceptions=True)
