"""The apiserver <-> edge wire format, derived from the EdgeHandle / FnCallHandle protocols.

One table for both sides (edge_service.py serves it, edge_client.py calls it): every protocol
method becomes `POST <prefix><method>` whose JSON body holds its arguments (one pydantic model
per method, from the method's type hints) and whose answer is `{"result": ...}` (again a model
from the return hint). A method added to EdgeHandle is on the wire without more code here; its
argument and result types are the dsec.types models the apiserver already speaks. Bytes travel
base64 inside JSON, except a `bytes` result (read_file, console), which is the raw body.
Streams (AsyncIterator results) are NDJSON, one item (ExecEvent, FsEvent) per line; an error mid-stream is a
line {"error": {...}}. port_connection is a WebSocket tunnel (TUNNEL_PATH).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, create_model

from dsec.types import DsecError, ERRORS_BY_CODE, NodeUnreachable, Unavailable

EDGE_PREFIX = "/v1/edge/"
FNCALL_PREFIX = "/v1/fncall/"
TUNNEL_PATH = "/v1/tunnel"
AUTH_HEADER = "authorization"
# WebSocket messages of the tunnel besides the raw bytes (binary frames): the first text frame
# says whether the connection into the sandbox is open; a later one half-closes (EOF).
TUNNEL_OK = '{"ok": true}'
TUNNEL_EOF = '{"eof": true}'

Kind = Literal["call", "bytes", "stream", "tunnel"]
_WIRE = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64", arbitrary_types_allowed=True)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    kind: Kind
    params: type[BaseModel]        # the arguments, by name
    result: type[BaseModel]        # {"result": value}; for a stream, one item


class EdgeUnreachable(NodeUnreachable):
    """The node's edge service did not answer (node gone, service down): a 503 like any
    unavailable node; nothing is known about whether the request took effect."""


def _kind(ret: Any) -> tuple[Kind, Any]:
    origin = typing.get_origin(ret)
    if origin is AsyncIterator or origin is typing.AsyncIterator:
        return "stream", typing.get_args(ret)[0]
    if origin is AbstractAsyncContextManager:
        return "tunnel", type(None)
    if ret is bytes:
        return "bytes", bytes
    return "call", ret


def specs(protocol: type) -> dict[str, MethodSpec]:
    """The wire spec of every public method of `protocol` (a typing.Protocol class)."""
    out: dict[str, MethodSpec] = {}
    for name, fn in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        hints = typing.get_type_hints(fn)
        kind, item = _kind(hints.get("return", type(None)))
        # a parameter the protocol gives a real default (not `...`) may be left out on the wire
        fields: dict[str, Any] = {p: (hints[p], ... if v.default in (inspect.Parameter.empty, Ellipsis) else v.default)
                                  for p, v in inspect.signature(fn).parameters.items() if p != "self"}
        params = create_model(f"{name}_args", __config__=_WIRE, **fields)
        result = create_model(f"{name}_result", __config__=_WIRE, result=(item, ...))
        out[name] = MethodSpec(name, kind, params, result)
    return out


def error_body(e: DsecError) -> dict[str, Any]:
    """e.to_body() plus what a refusal that passes carries (retry_after_s, edge/live.py)."""
    body = e.to_body()
    retry = getattr(e, "retry_after_s", None)
    if retry is not None:
        body["error"]["retry_after_s"] = retry
    return body


def error_from(body: Any, status: int | None) -> DsecError:
    """The DsecError subclass an error body names (the same the edge raised, by code). status:
    the HTTP status it came with; None for an error inside a stream or tunnel (the class's)."""
    detail = body.get("error") if isinstance(body, dict) else None
    if not isinstance(detail, dict):
        return Unavailable(f"the edge answered {status or 'an error'} without an error body", fix="see the edge's log")
    cls = ERRORS_BY_CODE.get(str(detail.get("code")), DsecError)
    e = cls(str(detail.get("message", "")), field=detail.get("field"), fix=detail.get("fix"))
    if status is not None and (cls is DsecError or type(e).status != status):
        e.status = status          # an unlisted subclass's own status and code survive
        e.code = str(detail.get("code", e.code))
    if detail.get("reason"):
        e.reason = str(detail["reason"])      # an ended sandbox's end reason (types/events.py)
    if detail.get("retry_after_s") is not None:
        e.retry_after_s = detail["retry_after_s"]   # type: ignore[attr-defined]
    return e
