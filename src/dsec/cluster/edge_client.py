"""HttpEdge: the EdgeHandle of a node whose edge runs elsewhere (edge_service.py), and
HttpFnCall: its FnCall service. What the apiserver gets back is what an in-process edge gives:
the same pydantic types, the same DsecError subclasses (by code), ExecEvent streams, and a
(reader, writer) pair for a port connection (a WebSocket tunnel relayed through a local socket
pair, so callers keep using asyncio streams). A node that does not answer is EdgeUnreachable
(503). An https edge is verified against the cluster CA and its node name (cluster_ca.py)."""

from __future__ import annotations

import asyncio
import builtins
import inspect
import json
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Generator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlencode

import httpx

from dsec import tracing
from dsec.apiserver.context import EdgeHandle, FnCallHandle
from dsec.cluster.cluster_ca import verify_failure
from dsec.cluster.wire import (EDGE_PREFIX, FNCALL_PREFIX, TUNNEL_EOF, TUNNEL_OK, TUNNEL_PATH, EdgeUnreachable,
                               MethodSpec, error_from, specs)
from dsec.types import DsecError, FnCallRequest, FnCallResult, InvalidArgument

CONNECT_TIMEOUT_S = 5.0
TUNNEL_CHUNK = 64 * 1024

EDGE_SPECS = specs(EdgeHandle)
FNCALL_SPECS = specs(FnCallHandle)


class _Bearer(httpx.Auth):
    """The cluster secret as it is now, on every request."""

    def __init__(self, secret: Callable[[], str]):
        self._secret = secret

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self._secret()}"
        yield request


class _Rpc:
    """POST <prefix><method> with the cluster secret; errors back as DsecErrors."""

    def __init__(self, url: str, secret: str | Callable[[], str], node_id: str,
                 http: httpx.AsyncClient | None = None, tls: ssl.SSLContext | None = None,
                 ca_file: str | None = None):
        """`secret`: the cluster secret, or what gives it at each call (a node's secret file,
        secret_file.py: a rotation takes effect on the next request). `tls`: what an https
        edge is verified with (cluster_ca.client_context of `ca_file`), its name checked."""
        self.url = url.rstrip("/")
        self.node_id = node_id
        self._secret = secret
        self._tls = tls if self.url.startswith("https://") else None
        self._ca_file = ca_file
        if self.url.startswith("https://") and tls is None:
            raise InvalidArgument(f"node {node_id!r} serves its edge over TLS ({self.url}) and this apiserver "
                                  "has no cluster CA to verify it", field="cluster_ca",
                                  fix="run `dsec cluster up` again: it installs <node-homes>/cluster-ca.pem on "
                                      "every node")
        # the node's name, not its address, is what its certificate proves
        self._ext = {"sni_hostname": node_id} if self._tls is not None else None
        # no read timeout: a create or a command takes as long as it takes (the edge bounds
        # them); a dead node is found by connect failing or the connection dropping
        self._http = http or httpx.AsyncClient(
            auth=_Bearer(self._current), timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            verify=self._tls if self._tls is not None else True)

    def _current(self) -> str:
        return self._secret if isinstance(self._secret, str) else self._secret()

    @property
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._current()}"}

    async def aclose(self) -> None:
        await self._http.aclose()

    def _unreachable(self, e: Exception) -> EdgeUnreachable:
        bad = verify_failure(e)
        if bad is not None:     # it answered, but cannot prove it is this cluster's node
            err = EdgeUnreachable(
                f"node {self.node_id!r}: its edge certificate failed verification against the cluster CA "
                f"{self._ca_file or ''} ({bad.verify_message or bad})", field="cluster_ca",
                fix="the replica's cluster CA file (<node-homes>/cluster-ca.pem, from the `--home` of "
                    "`dsec cluster up`) must be the CA that issued the edges' certificates: run `dsec cluster "
                    "up` again with the same --home and --node-homes")
            err.delivered = False
            return err
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        err = EdgeUnreachable(f"node {self.node_id!r} did not answer ({detail})", field="node",
                              fix="the node may have left the cluster: `dsec cluster status`; retry")
        # no connection was made: the request cannot have taken effect on the node
        err.delivered = not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
        return err

    async def _post(self, spec: MethodSpec, prefix: str, kwargs: dict[str, Any]) -> httpx.Response:
        body = spec.params(**kwargs).model_dump_json()
        try:
            resp = await self._http.post(self.url + prefix + spec.name, content=body,
                                         headers=_headers(), extensions=self._ext)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        if resp.status_code >= 400:
            raise _decode_error(resp.content, resp.status_code)
        return resp

    async def _call(self, table: dict[str, MethodSpec], prefix: str, method: str, **kwargs: Any) -> Any:
        spec = table[method]
        resp = await self._post(spec, prefix, kwargs)
        if spec.kind == "bytes":
            return resp.content
        return getattr(spec.result.model_validate_json(resp.content), "result")

    async def _stream(self, method: str, **kwargs: Any) -> AsyncIterator[Any]:
        spec = EDGE_SPECS[method]
        body = spec.params(**kwargs).model_dump_json()
        req = self._http.build_request("POST", self.url + EDGE_PREFIX + method, content=body, headers=_headers(),
                                       extensions=self._ext)
        try:
            resp = await self._http.send(req, stream=True)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        try:
            if resp.status_code >= 400:
                raise _decode_error(await resp.aread(), resp.status_code)
            try:
                async for line in resp.aiter_lines():
                    if not line:
                        continue
                    if line.startswith('{"error"'):
                        raise _decode_error(line.encode(), None)
                    yield getattr(spec.result.model_validate_json(line), "result")
            except httpx.TransportError as e:   # the node went away mid-stream
                raise self._unreachable(e) from e
        finally:
            await resp.aclose()


def _headers() -> dict[str, str]:
    """JSON, and the current span's traceparent when traces are on (the replica -> edge hop)."""
    h = {"content-type": "application/json"}
    return tracing.inject(h) if tracing.on() else h   # type: ignore[return-value]


def _decode_error(content: bytes, status: int | None) -> DsecError:
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    return error_from(body, status)


def _verb(protocol: type, spec: MethodSpec) -> Any:
    """The client side of one protocol method: its signature (positional and keyword arguments
    bound as the protocol declares them), sent as `spec` says."""
    sig = inspect.signature(getattr(protocol, spec.name))

    def kwargs_of(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return {k: v for k, v in bound.arguments.items() if k != "self"}

    if spec.kind == "stream":
        def stream(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            return self._stream(spec.name, **kwargs_of(self, args, kwargs))
        method: Any = stream
    else:
        async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await self._call(EDGE_SPECS, EDGE_PREFIX, spec.name, **kwargs_of(self, args, kwargs))
        method = call
    method.__name__ = method.__qualname__ = spec.name
    method.__signature__ = sig
    method.__doc__ = getattr(protocol, spec.name).__doc__
    return method


class HttpEdge(_Rpc):
    """EdgeHandle over HTTP (see the module doc). Every verb but the tunnel is derived from the
    protocol's declaration (below the class): a verb added to EdgeHandle needs no code here."""

    @asynccontextmanager
    async def port_connection(self, sandbox_id: str, port: int
                              ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        """A TCP connection to `port` in the sandbox: a WebSocket to the edge's tunnel, relayed
        through a local socket pair so the caller gets plain asyncio streams."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import WebSocketException

        ws_url = ("ws" + self.url.removeprefix("http") + TUNNEL_PATH + "?"
                  + urlencode({"sandbox_id": sandbox_id, "port": port}))
        tls: dict[str, Any] = {"ssl": self._tls, "server_hostname": self.node_id} if self._tls else {}
        try:
            ws = await connect(ws_url, additional_headers=self._auth, open_timeout=CONNECT_TIMEOUT_S,
                               max_size=1 << 20, compression=None, ping_interval=None, **tls)
        except (OSError, WebSocketException, TimeoutError) as e:
            raise self._unreachable(e) from e
        pumps: list[asyncio.Task[None]] = []
        relay: asyncio.StreamWriter | None = None
        try:
            first = await ws.recv()
            if first != TUNNEL_OK:
                raise _decode_error(first.encode() if isinstance(first, str) else first, None)
            mine, theirs = socket.socketpair()
            reader, writer = await asyncio.open_connection(sock=mine)
            r2, w2 = await asyncio.open_connection(sock=theirs)
            relay = w2

            async def up() -> None:       # caller -> edge
                while data := await r2.read(TUNNEL_CHUNK):
                    await ws.send(data)
                await ws.send(TUNNEL_EOF)

            async def down() -> None:     # edge -> caller; the edge closing is EOF
                try:
                    async for msg in ws:
                        if isinstance(msg, bytes):
                            w2.write(msg)
                            await w2.drain()
                finally:
                    if w2.can_write_eof():
                        w2.write_eof()

            pumps = [asyncio.create_task(up()), asyncio.create_task(down())]
            try:
                yield reader, writer
            finally:
                writer.close()
        except WebSocketException as e:
            raise self._unreachable(e) from e
        finally:
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await ws.close()
            if relay is not None:
                relay.close()


for _spec in EDGE_SPECS.values():
    if _spec.kind != "tunnel":          # port_connection: the WebSocket relay above
        setattr(HttpEdge, _spec.name, _verb(EdgeHandle, _spec))


class HttpFnCall(_Rpc):
    """FnCallHandle over HTTP: the node's FnCall service beside its edge."""

    async def run(self, req: FnCallRequest, project: str | None = None) -> FnCallResult:
        return await self._call(FNCALL_SPECS, FNCALL_PREFIX, "run", req=req, project=project)

    async def pool_stats(self) -> builtins.list[dict]:
        return await self._call(FNCALL_SPECS, FNCALL_PREFIX, "pool_stats")
