"""OpenTelemetry traces (issue 26.4, dsec.tracing): each process writes its spans as OTLP-JSON
(DSEC_TRACES_FILE; the client with dsec.tracing.setup), and joined by trace id one create is
one trace across the client and the server, with the edge's stages (image, admission, start,
agent ready) as children of its create span; an exec likewise. No command text on any span.
The cluster's replica -> edge hop carries the trace over HTTP too (HttpEdge -> edge service)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import LOCAL_DNS_SINK, ServerProc, side_server

from dsec.types import NodeCapacity, NodeStatus

MARK = "trace-cmd-text-4711"

CLIENT = textwrap.dedent("""
    import asyncio, sys
    from dsec import tracing
    from dsec.sdk.client import Client
    tracing.setup("test-client", traces_file=sys.argv[3])

    async def main():
        async with Client(sys.argv[1], sys.argv[2], autostart=False) as c:
            sb = await c.create_container(image="busybox")
            try:
                assert (await sb.run("echo " + sys.argv[4])).exit_code == 0
            finally:
                await sb.stop()
            print(sb.id)
    asyncio.run(main())
    tracing.shutdown()
""")


def spans(path: Path) -> list[dict]:
    """Every span of an OTLP-JSON lines file, with its resource's service.name as `service`."""
    out = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            service = next(a["value"]["stringValue"] for a in rs["resource"]["attributes"] if a["key"] == "service.name")
            for ss in rs["scopeSpans"]:
                out += [{**s, "service": service} for s in ss["spans"]]
    return out


def run_client(script: str, srv: ServerProc, spans_file: Path) -> subprocess.CompletedProcess:
    """Run a traced client script against the server (its spans go to spans_file); it must succeed."""
    p = subprocess.run([sys.executable, "-c", script, srv.url, srv.key, str(spans_file), MARK],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def attrs(span: dict) -> dict:
    """Attribute values as Python values (OTLP-JSON writes 64-bit ints as strings)."""
    return {a["key"]: int(a["value"]["intValue"]) if "intValue" in a["value"] else next(iter(a["value"].values()))
            for a in span.get("attributes", [])}


@pytest.fixture(scope="module")
def traced(dsec_home, images, tmp_path_factory):
    """A server of its own with DSEC_TRACES_FILE set (own bridge: concurrent test servers never share one)."""
    out = tmp_path_factory.mktemp("traces-out") / "server-spans.jsonl"
    tag = os.getpid() % 100000
    with side_server(dsec_home, tmp_path_factory, "traces",
                     {"DSEC_TRACES_FILE": str(out), "DSEC_NET_BRIDGE": f"dtr{tag}",
                      "DSEC_NET_SUBNET": f"10.196.{os.getpid() % 250}.0/24",
                      "DSEC_NET_DNS_UPSTREAM": LOCAL_DNS_SINK}) as srv:
        yield srv, out


def test_one_create_is_one_trace_across_processes(traced, tmp_path):
    srv, server_file = traced
    client_file = tmp_path / "client-spans.jsonl"
    p = run_client(CLIENT, srv, client_file)
    sandbox_id = p.stdout.strip().splitlines()[-1]
    client, server = spans(client_file), spans(server_file)
    by_id = {s["spanId"]: s for s in client + server}

    create = next(s for s in client if s["name"] == "dsec.sandbox.create")
    assert create["kind"] == 3 and attrs(create)["dsec.sandbox_id"] == sandbox_id, create
    trace = [s for s in server if s["traceId"] == create["traceId"]]
    names = {s["name"] for s in trace}
    assert {"POST /v1/sandboxes", "dsec.edge.create", "dsec.create.image", "dsec.create.admission",
            "dsec.create.slot_wait", "dsec.create.start", "dsec.create.agent_ready"} <= names, names
    assert {s["service"] for s in trace} == {"dsec"} and create["service"] == "test-client"
    # the server's span continues the client's across the process hop (FastAPI, when tracing is on, adds
    # its own HTTP span beside dsec's: one of the two is the child of the client's span)
    https = [s for s in trace if s["name"] == "POST /v1/sandboxes"]
    assert any(s.get("parentSpanId") == create["spanId"] and s["kind"] == 2 for s in https), https
    http = next(s for s in https if "dsec.project" in attrs(s))
    assert attrs(http)["http.response.status_code"] == 201 and attrs(http)["dsec.project"], http
    edge = next(s for s in trace if s["name"] == "dsec.edge.create")
    assert attrs(edge)["dsec.sandbox_id"] == sandbox_id

    def ancestors(s: dict) -> list[str]:
        chain = []
        while s.get("parentSpanId") in by_id:
            s = by_id[s["parentSpanId"]]
            chain.append(s["spanId"])
        return chain
    assert http["spanId"] in ancestors(edge), edge
    for stage in ("dsec.create.image", "dsec.create.admission", "dsec.create.slot_wait", "dsec.create.start",
                  "dsec.create.agent_ready"):
        st = next(s for s in trace if s["name"] == stage)
        assert st["parentSpanId"] == edge["spanId"], st
        assert int(edge["startTimeUnixNano"]) <= int(st["startTimeUnixNano"]) <= int(st["endTimeUnixNano"]) \
            <= int(edge["endTimeUnixNano"]), (st, edge)

    # the exec: client -> POST .../exec -> the edge's exec span, one trace; no command text anywhere
    run = next(s for s in client if s["name"] == "dsec.sandbox.exec")
    exec_trace = {s["name"]: s for s in server if s["traceId"] == run["traceId"]}
    assert "POST /v1/sandboxes/{sandbox_id}/exec" in exec_trace and "dsec.edge.exec" in exec_trace, exec_trace.keys()
    assert attrs(exec_trace["dsec.edge.exec"])["dsec.exit_code"] == 0
    assert run["traceId"] != create["traceId"]
    assert MARK not in client_file.read_text() + server_file.read_text()


HOP = textwrap.dedent("""
    import asyncio, json, sys
    from dsec import tracing
    from dsec.cluster.edge_client import HttpEdge
    from dsec.cluster.edge_service import bind, edge_app, serve, stop
    from dsec.types import ExecEvent, ExecResult, NodeStatus
    tracing.setup("hop", traces_file=sys.argv[1])

    class Edge:      # the edge service's target: what the hop carries is tested, not the edge
        async def status(self):
            with tracing.span("inside-edge"):
                return NodeStatus.model_validate_json(sys.argv[2])

        async def exec_follow(self, sandbox_id, exec_id):     # a stream: its span spans every item
            yield ExecEvent(type="start", exec_id=exec_id)
            await asyncio.sleep(0.05)
            with tracing.span("inside-stream"):
                yield ExecEvent(type="exit", exec_id=exec_id, result=ExecResult(exec_id=exec_id, exit_code=0))

    async def main():
        sock = bind("127.0.0.1", 0)
        server = await serve(edge_app(Edge(), "s" * 32), sock)
        try:
            e = HttpEdge(f"http://127.0.0.1:{sock.getsockname()[1]}", "s" * 32, "n1")
            with tracing.span("replica"):
                await e.status()
            with tracing.span("replica-stream"):
                assert [ev.type async for ev in e.exec_follow("sb-x.000000000000", "7")] == ["start", "exit"]
        finally:
            await stop(server)
    asyncio.run(main())
    tracing.shutdown()
""")


def test_the_replica_to_edge_hop_carries_the_trace(tmp_path):
    out = tmp_path / "hop.jsonl"
    status = NodeStatus(node_id="n1", healthy=True, backends=["container"],
                        capacity=NodeCapacity(cpu_cores=1, memory_mb=1024, max_sandboxes=1)).model_dump_json()
    p = subprocess.run([sys.executable, "-c", HOP, str(out), status], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    got = {s["name"]: s for s in spans(out)}
    replica, server, inside = got["replica"], got["dsec.edge/status"], got["inside-edge"]
    assert server["parentSpanId"] == replica["spanId"] and server["kind"] == 2, server
    assert inside["parentSpanId"] == server["spanId"]
    assert len({replica["traceId"], server["traceId"], inside["traceId"]}) == 1
    # a stream's hop: one server span over the stream, continuing the replica's trace
    replica, server, inside = got["replica-stream"], got["dsec.edge/exec_follow"], got["inside-stream"]
    assert server["parentSpanId"] == replica["spanId"] and server["kind"] == 2, server
    assert inside["parentSpanId"] == server["spanId"]
    assert int(server["startTimeUnixNano"]) <= int(inside["startTimeUnixNano"]) <= int(server["endTimeUnixNano"])


STREAMED = textwrap.dedent("""
    import asyncio, json, sys
    from dsec import tracing
    from dsec.sdk.client import Client
    tracing.setup("test-client", traces_file=sys.argv[3])

    async def main():
        async with Client(sys.argv[1], sys.argv[2], autostart=False) as c:
            sb = await c.create_container(image="busybox")
            try:
                events = [ev async for ev in sb.stream("echo " + sys.argv[4] + "; exit 3")]
                assert events[-1].type == "exit" and events[-1].result.exit_code == 3, events
                started = await sb.start("sleep 0.5; exit 4")
                followed = [ev async for ev in sb.follow(started.exec_id)]
                assert followed[-1].result.exit_code == 4, followed
                assert (await sb.attach(started.exec_id)).exit_code == 4
            finally:
                await sb.stop()
            print(json.dumps({"sandbox": sb.id, "exec": started.exec_id}))
    asyncio.run(main())
    tracing.shutdown()
""")


def test_streamed_execs_are_one_trace_with_the_agent_round_trip(traced, tmp_path):
    """A streamed run, a follow of a started exec and an attach: each is one trace from the
    client's span through the apiserver's route to the edge's span over the whole stream, and
    the edge's round trip to the agent (dsec.agent.exec) is a child inside its time."""
    from dsec.testing.waiting import wait_until_sync
    srv, server_file = traced
    client_file = tmp_path / "streamed-spans.jsonl"
    run_client(STREAMED, srv, client_file)
    client = spans(client_file)
    by_name = {s["name"]: s for s in client}
    stream, follow, attach = (by_name[n] for n in ("dsec.sandbox.exec_stream", "dsec.sandbox.exec_follow",
                                                    "dsec.sandbox.attach"))
    assert all(s["kind"] == 3 for s in (stream, follow, attach))
    assert attrs(stream)["dsec.exit_code"] == 3 and attrs(follow)["dsec.exit_code"] == 4, (stream, follow)
    assert attrs(attach)["dsec.exit_code"] == 4, attach
    # a stream's server spans end with the stream: wait until the server has written them
    want = {stream["traceId"]: "dsec.edge.exec_stream", follow["traceId"]: "dsec.edge.exec_follow",
            attach["traceId"]: "dsec.edge.attach"}

    def written() -> list[dict] | None:
        got = spans(server_file)
        names = {(s["traceId"], s["name"]) for s in got}
        return got if all((t, n) in names for t, n in want.items()) else None
    server = wait_until_sync(written, timeout_s=30, what="the streams' server spans")
    by_id = {s["spanId"]: s for s in client + server}

    def ancestors(s: dict) -> list[str]:
        chain = []
        while s.get("parentSpanId") in by_id:
            s = by_id[s["parentSpanId"]]
            chain.append(s["spanId"])
        return chain

    for caller, route, edge_name in ((stream, "POST /v1/sandboxes/{sandbox_id}/exec/stream", "dsec.edge.exec_stream"),
                                     (follow, "GET /v1/sandboxes/{sandbox_id}/execs/{exec_id}/stream",
                                      "dsec.edge.exec_follow"),
                                     (attach, "GET /v1/sandboxes/{sandbox_id}/execs/{exec_id}", "dsec.edge.attach")):
        trace = [s for s in server if s["traceId"] == caller["traceId"]]
        https = [s for s in trace if s["name"] == route]
        assert any(s.get("parentSpanId") == caller["spanId"] and s["kind"] == 2 for s in https), (route, trace)
        edge = next(s for s in trace if s["name"] == edge_name)
        assert caller["spanId"] in ancestors(edge), (edge_name, edge)
        assert attrs(edge)["dsec.exit_code"] == attrs(caller)["dsec.exit_code"], edge
        # the edge's span covers the stream: it ends no earlier than the client got the start
        assert int(edge["endTimeUnixNano"]) > int(edge["startTimeUnixNano"]), edge
    # the streamed run's agent round trip: a child of the edge's stream span, inside its time
    trace = [s for s in server if s["traceId"] == stream["traceId"]]
    edge = next(s for s in trace if s["name"] == "dsec.edge.exec_stream")
    agent = next(s for s in trace if s["name"] == "dsec.agent.exec")
    assert agent["parentSpanId"] == edge["spanId"] and attrs(agent)["dsec.exit_code"] == 3, agent
    assert int(edge["startTimeUnixNano"]) <= int(agent["startTimeUnixNano"]) <= int(agent["endTimeUnixNano"]) \
        <= int(edge["endTimeUnixNano"]), (agent, edge)
    assert MARK not in client_file.read_text() + server_file.read_text()
