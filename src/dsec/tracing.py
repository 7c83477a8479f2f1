"""OpenTelemetry traces of creates and execs: SDK -> apiserver -> edge -> backend stages.

Off by default, and then free: `on()` is one global read, no span object is made and
opentelemetry is never imported. A server turns it on at its composition root with `setup()`
(DSEC_OTLP_ENDPOINT and/or DSEC_TRACES_FILE, dsec.settings.ObservabilitySettings); a client
program turns it on by configuring OpenTelemetry itself (any global TracerProvider, or
`dsec.tracing.setup()`): the SDK then opens a CLIENT span per create/exec and sends its W3C
`traceparent`. Each HTTP hop (SDK -> apiserver, apiserver -> edge service in a cluster) carries
it; the receiver continues the trace. Span names and attributes: docs/traces.md. No secrets,
no command text, no file contents are put on spans.

Needs the opentelemetry-api and -sdk packages (`pip install 'dsec-sandbox[traces]'`), imported
only when traces are on: without them the SDK works as before and a server asked for traces
says which package to install.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

from dsec.types import InvalidArgument

T = TypeVar("T")
TRACES_INSTALL = "pip install 'dsec-sandbox[traces]' (opentelemetry-api and opentelemetry-sdk)"
TRACER_NAME = "dsec"

_on = False          # setup() ran in this process
_follow_program = True   # a client: follow the program's own OpenTelemetry setup (a server: start() clears it)
_tracer: Any = None
_program_on = False
_checked_at = float("-inf")
RECHECK_S = 1.0      # get_tracer_provider() reads the environment (~7 µs): asked at most once a second


def on() -> bool:
    """Whether spans are made in this process: setup() ran, or (in a client program) the
    program configured an OpenTelemetry TracerProvider of its own."""
    global _program_on, _checked_at
    if _on:
        return True
    if not _follow_program:
        return False
    mod = sys.modules.get("opentelemetry.trace")      # never imported: nobody configured tracing
    if mod is None:
        return False
    now = time.monotonic()
    if now - _checked_at > RECHECK_S:
        _checked_at = now
        _program_on = type(mod.get_tracer_provider()).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider")
    return _program_on


def tracer() -> Any:
    global _tracer
    if _tracer is None:
        from opentelemetry import trace
        _tracer = trace.get_tracer(TRACER_NAME)
    return _tracer


def setup(service: str, *, otlp_endpoint: str | None = None, traces_file: Path | str | None = None,
          sample: float = 1.0) -> None:
    """Make this process export spans (a server's composition root, or a client program):
    to an OTLP/HTTP collector, and/or as OTLP-JSON lines to a file. Idempotent per process."""
    global _on, _tracer
    if _on:
        return
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as e:
        raise InvalidArgument(f"traces are on (DSEC_OTLP_ENDPOINT or DSEC_TRACES_FILE) but OpenTelemetry is not "
                              f"installed ({e.name})", field="DSEC_OTLP_ENDPOINT",
                              fix=TRACES_INSTALL + "; or unset DSEC_OTLP_ENDPOINT and DSEC_TRACES_FILE") from None
    from dsec.otlp_json import FileExporter, HttpExporter
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              sampler=ParentBased(TraceIdRatioBased(sample)))
    if traces_file:
        # written at each span's end: a test reads the file right after the call
        provider.add_span_processor(SimpleSpanProcessor(FileExporter(Path(traces_file))))
    if otlp_endpoint:
        provider.add_span_processor(BatchSpanProcessor(HttpExporter(otlp_endpoint)))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer(TRACER_NAME)
    _on = True


def start(obs: Any, service: str) -> None:
    """A server's composition root: setup() from its ObservabilitySettings (dsec.settings)
    when they turn traces on; else off for good (no per-call check of OpenTelemetry's state)."""
    global _follow_program
    _follow_program = False
    if obs.traces_on:
        setup(service, otlp_endpoint=obs.otlp_endpoint, traces_file=obs.traces_file, sample=obs.trace_sample)


def shutdown() -> None:
    """Flush what waits (a server's shutdown)."""
    if _on:
        from opentelemetry import trace
        getattr(trace.get_tracer_provider(), "shutdown", lambda: None)()


@contextlib.contextmanager
def span(name: str, kind: str = "internal", attrs: Mapping[str, Any] | None = None,
         parent: Any = None) -> Iterator[Any]:
    """A span around the block (a no-op when traces are off); `kind`: internal, server,
    client; `parent`: a context from extract() (default: the current span)."""
    if not on():
        yield None
        return
    from opentelemetry.trace import SpanKind
    with tracer().start_as_current_span(name, context=parent, kind=getattr(SpanKind, kind.upper()),
                                        attributes=dict(attrs or {})) as s:
        yield s


def set_attrs(s: Any, attrs: Mapping[str, Any]) -> None:
    if s is not None:
        for k, v in attrs.items():
            if v is not None:
                s.set_attribute(k, v)


def inject(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current span's W3C traceparent (and tracestate) to outgoing headers."""
    if on():
        from opentelemetry.propagate import inject as _inject
        _inject(headers)
    return headers


def extract(headers: Mapping[str, str]) -> Any:
    """The caller's trace context from incoming headers (None: traces off or none sent)."""
    if not on() or "traceparent" not in headers:
        return None
    from opentelemetry.propagate import extract as _extract
    return _extract(dict(headers))


def past_span(name: str, start_ns: int, end_ns: int, attrs: Mapping[str, Any] | None = None) -> None:
    """A child of the current span that already happened (a stage timed by laps); it starts
    no earlier than its parent."""
    from opentelemetry import trace
    parent_start = getattr(trace.get_current_span(), "start_time", None) or 0
    s = tracer().start_span(name, attributes=dict(attrs or {}), start_time=max(start_ns, parent_start))
    s.end(end_time=end_ns)


def open_span(name: str, kind: str = "internal", attrs: Mapping[str, Any] | None = None,
              parent: Any = None) -> Any:
    """A span that is NOT made current, for work spread over an async generator's yields (a
    current span set there could be reset in another context when the consumer goes away);
    None when traces are off. `parent`: a context from extract(), default the current span.
    End it with close_span()."""
    if not on():
        return None
    from opentelemetry.trace import SpanKind
    return tracer().start_span(name, context=parent, kind=getattr(SpanKind, kind.upper()),
                               attributes=dict(attrs or {}))


def close_span(s: Any, attrs: Mapping[str, Any] | None = None, error: BaseException | None = None) -> None:
    if s is None:
        return
    set_attrs(s, attrs or {})
    if error is not None and not isinstance(error, GeneratorExit):
        from opentelemetry.trace import Status, StatusCode
        s.set_status(Status(StatusCode.ERROR, type(error).__name__))
    s.end()


def inject_span(headers: MutableMapping[str, str], s: Any) -> MutableMapping[str, str]:
    """Add `s`'s traceparent (a span from open_span) to outgoing headers."""
    if s is not None:
        from opentelemetry import trace
        from opentelemetry.propagate import inject as _inject
        _inject(headers, context=trace.set_span_in_context(s))
    return headers


async def traced(name: str, items: AsyncIterator[T], kind: str = "internal", attrs: Mapping[str, Any] | None = None,
                 parent: Any = None, note: Callable[[Any, T], None] | None = None) -> AsyncIterator[T]:
    """`items` inside one span from the first item asked for to the last (a streamed exec, an
    attach): the span is current only while `items` computes its next item, so the spans it
    opens are its children. `note(span, item)` may add attributes (an exit code). Callers wrap
    only when on(): off, no generator layer is added."""
    from opentelemetry import context as otel_context, trace
    s = open_span(name, kind, attrs, parent)
    it = aiter(items)
    failed: BaseException | None = None
    try:
        while True:
            token = otel_context.attach(trace.set_span_in_context(s))
            try:
                item = await anext(it)
            except StopAsyncIteration:
                break
            finally:
                otel_context.detach(token)
            if note is not None:
                note(s, item)
            yield item
    except BaseException as e:
        failed = e
        raise
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
        close_span(s, error=failed)
