"""The apiserver <-> edge wire (dsec.cluster.wire): derived from the EdgeHandle protocol, so
HttpEdge must keep up with it; errors survive the trip as the same classes."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("websockets", reason="cluster mode's tunnel client: pip install -e '.[cluster]'")

from dsec.apiserver.context import EdgeHandle, FnCallHandle  # noqa: E402
from dsec.cluster.edge_client import HttpEdge, HttpFnCall  # noqa: E402
from dsec.cluster.wire import error_body, error_from, specs  # noqa: E402
from dsec.types import ERRORS_BY_CODE, CapacityExceeded, DsecError, ExecEvent, SandboxFailed, SandboxInfo  # noqa: E402


@pytest.mark.parametrize("protocol, client", [(EdgeHandle, HttpEdge), (FnCallHandle, HttpFnCall)])
def test_http_client_implements_every_protocol_method(protocol, client):
    table = specs(protocol)
    assert table, protocol
    for name, spec in table.items():
        impl = getattr(client, name, None)
        assert impl is not None, f"{client.__name__} lacks {name}"
        want = [p for p in inspect.signature(getattr(protocol, name)).parameters if p != "self"]
        got = [p for p in inspect.signature(impl).parameters if p != "self"]
        assert got == want, (name, got, want)
        assert list(spec.params.model_fields) == want


def test_kinds_follow_the_return_types():
    t = specs(EdgeHandle)
    assert t["exec_stream"].kind == t["exec_follow"].kind == "stream"
    assert t["port_connection"].kind == "tunnel"
    assert t["read_file"].kind == t["console"].kind == "bytes"
    assert t["get"].kind == "call" and t["get"].result.model_fields["result"].annotation is SandboxInfo
    assert t["exec_stream"].result.model_fields["result"].annotation is ExecEvent


def test_bytes_arguments_survive_json():
    spec = specs(EdgeHandle)["write_file"]
    data = bytes(range(256))
    body = spec.params(sandbox_id="sb-n1.0123456789ab", path="/x", data=data, mode=0o600, mkdirs=True).model_dump_json()
    assert spec.params.model_validate_json(body).data == data


@pytest.mark.parametrize("cls", sorted(set(ERRORS_BY_CODE.values()), key=lambda c: c.code))
def test_errors_cross_as_the_same_class(cls):
    e = cls("msg", field="f", fix="do this")
    back = error_from(error_body(e), e.status)
    assert type(back) is cls and (back.message, back.field, back.fix, back.status) == ("msg", "f", "do this", e.status)
    assert type(error_from(error_body(e), None)) is cls          # inside a stream: no HTTP status


def test_an_ended_sandboxs_reason_survives():
    back = error_from(error_body(SandboxFailed("sandbox x failed: out of memory", reason="oom_killed")), 502)
    assert type(back) is SandboxFailed and back.reason == "oom_killed"
    assert error_from(error_body(SandboxFailed("no reason")), 502).reason is None


def test_retry_after_and_unlisted_subclasses_survive():
    class SlotsFull(CapacityExceeded):
        retry_after_s = 2

    back = error_from(error_body(SlotsFull("full")), 429)
    assert isinstance(back, CapacityExceeded) and back.retry_after_s == 2   # type: ignore[attr-defined]

    class Teapot(DsecError):
        status, code = 418, "teapot"

    back = error_from(error_body(Teapot("short and stout")), 418)
    assert (back.status, back.code, back.message) == (418, "teapot", "short and stout")
    assert error_from("not json", 502).status == 503


async def test_unreachable_says_whether_the_request_was_delivered():
    """Connection refused: never delivered (placement may try another node). Accepted, then
    dropped without an answer: it may have taken effect (no second try elsewhere)."""
    import asyncio
    import socket

    from dsec.cluster.wire import EdgeUnreachable
    from dsec.types import NodeUnreachable

    with socket.socket() as s:                  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    edge = HttpEdge(f"http://127.0.0.1:{closed}", "secret", "gone")
    try:
        with pytest.raises(EdgeUnreachable) as e:
            await edge.status()
        assert isinstance(e.value, NodeUnreachable) and e.value.delivered is False
        assert e.value.field == "node" and "gone" in e.value.message
    finally:
        await edge.aclose()

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)                    # the request arrived; the node dies before answering
        writer.close()
    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    edge = HttpEdge(f"http://127.0.0.1:{port}", "secret", "dying")
    try:
        with pytest.raises(EdgeUnreachable) as e:
            await edge.status()
        assert e.value.delivered is True
    finally:
        await edge.aclose()
        server.close()


def test_file_calls_carry_their_user():
    """read/write/list/remove take `user` (issue 24, item 4); left out, it is the sandbox's user."""
    for name in ("read_file", "write_file", "list_dir", "remove_file"):
        params = specs(EdgeHandle)[name].params
        assert params.model_fields["user"].default is None, name
    spec = specs(EdgeHandle)["read_file"]
    body = spec.params(sandbox_id="sb-n1.0123456789ab", path="/root/x", maxlen=10, user="root").model_dump_json()
    assert spec.params.model_validate_json(body).user == "root"


def test_stop_carries_the_end_reason():
    """The apiserver's own stops (`dsec nodes drain --stop`) end `preempted` on the node's edge
    too (issue 26, item 3); a caller's stop stays `killed`."""
    params = specs(EdgeHandle)["stop"].params
    assert params.model_fields["end"].default == "killed"
    body = params(sandbox_id="sb-n1.0123456789ab", reason="drained", end="preempted").model_dump_json()
    assert params.model_validate_json(body).end == "preempted"
