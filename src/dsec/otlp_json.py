"""OpenTelemetry span exporters in OTLP's JSON encoding: to a file (one
ExportTraceServiceRequest per line) and to an OTLP/HTTP collector (POST {endpoint}/v1/traces,
Content-Type application/json, which collectors accept beside protobuf).

One encoder for both, and no protobuf or gRPC dependency (docs/decisions.md, "Traces").
Imported only when traces are on (dsec.tracing.setup), after opentelemetry-sdk.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("dsec.tracing")
HTTP_TIMEOUT_S = 10.0


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"stringValue": str(v)}


def _attrs(attrs: Any) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in (attrs or {}).items()]


def _span(s: ReadableSpan) -> dict[str, Any]:
    ctx = s.get_span_context()
    out: dict[str, Any] = {
        "traceId": f"{ctx.trace_id:032x}", "spanId": f"{ctx.span_id:016x}", "name": s.name,
        "kind": s.kind.value + 1,     # OTLP's enum: 1 internal, 2 server, 3 client (Python's starts at 0)
        "startTimeUnixNano": str(s.start_time or 0), "endTimeUnixNano": str(s.end_time or 0),
        "attributes": _attrs(s.attributes),
        "status": {"code": s.status.status_code.value, **({"message": s.status.description}
                                                           if s.status.description else {})},
    }
    if s.parent is not None:
        out["parentSpanId"] = f"{s.parent.span_id:016x}"
    if s.events:
        out["events"] = [{"name": e.name, "timeUnixNano": str(e.timestamp), "attributes": _attrs(e.attributes)}
                         for e in s.events]
    return out


def encode(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """An ExportTraceServiceRequest: spans grouped by resource, then by instrumentation scope."""
    by_resource: dict[int, tuple[Any, dict[tuple[str, str], list[dict[str, Any]]]]] = {}
    for s in spans:
        res, scopes = by_resource.setdefault(id(s.resource), (s.resource, {}))
        scope = s.instrumentation_scope
        scopes.setdefault((scope.name if scope else "", (scope.version or "") if scope else ""), []).append(_span(s))
    return {"resourceSpans": [
        {"resource": {"attributes": _attrs(res.attributes if res else {})},
         "scopeSpans": [{"scope": {"name": n, **({"version": v} if v else {})}, "spans": ss}
                        for (n, v), ss in scopes.items()]}
        for res, scopes in by_resource.values()]}


class FileExporter(SpanExporter):
    """Appends one JSON line per export (tests and debugging)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = json.dumps(encode(spans), separators=(",", ":")) + "\n"
        try:
            with self._lock, open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:
            log.warning("could not write spans", extra={"path": str(self.path), "error": str(e)})
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class HttpExporter(SpanExporter):
    """POSTs each batch to an OTLP/HTTP collector as JSON (from the batch processor's thread)."""

    def __init__(self, endpoint: str):
        base = endpoint.rstrip("/")
        self.url = base if base.endswith("/v1/traces") else base + "/v1/traces"
        self._http = httpx.Client(timeout=HTTP_TIMEOUT_S)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            r = self._http.post(self.url, content=json.dumps(encode(spans), separators=(",", ":")),
                                headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            log.warning("OTLP export failed", extra={"url": self.url, "error": f"{type(e).__name__}: {e}"})
            return SpanExportResult.FAILURE
        if r.status_code >= 300:
            log.warning("OTLP export refused", extra={"url": self.url, "status": r.status_code,
                                                      "answer": r.text[:200]})
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._http.close()
