"""The apiserver talking to a real edge over HTTP (dsec.cluster.edge_service / edge_client):
everything the SDK does against one node, through HttpEdge instead of the in-process edge;
errors crossing the wire as the same DsecError subclasses; the edge service's authentication,
and that a sandbox cannot use its own node's edge service (containment).

One process: a real edge (crun containers) served on 0.0.0.0 (the worst case for containment),
the real apiserver app with `edges={node: HttpEdge(...)}` on 127.0.0.1, the SDK against it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import tempfile
from pathlib import Path

import httpx
import pytest
from conftest import NO_PSI_ADMISSION, link_downloads, requires_root

from dsec import Client
from dsec.types import CapacityExceeded, Conflict, InvalidArgument, NotFound, Unavailable

NODE = "h1"
HANDLER = """#!/bin/sh
cr=$(printf '\\r')
while read -r l; do [ "$l" = "$cr" ] || [ -z "$l" ] && break; done
printf 'HTTP/1.1 200 OK\\r\\nContent-Length: 5\\r\\nConnection: close\\r\\n\\r\\nhello'
"""


def host_ip() -> str:
    """This host's address on its default route (what a sandbox would try after the gateway)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))     # TEST-NET: nothing is sent
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


@pytest.fixture(scope="module")
async def split():
    """(sdk client, HttpEdge, edge service url, secret, bridge gateway) of a one-node split deployment."""
    requires_root()
    from dsec.apiserver.app import create_app
    from dsec.apiserver.context import ApiContext
    from dsec.cluster.edge_client import HttpEdge, HttpFnCall
    from dsec.cluster.edge_service import bind, edge_app, serve, stop
    from dsec.config import Paths
    from dsec.embedded.server import node_services, system_project
    from dsec.iam import IAM
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService
    from dsec.placement import Placer
    from dsec.settings import Settings
    from dsec.testing.isolated import cleanup_home
    from dsec.watcher import Watcher

    home = Path(tempfile.mkdtemp(prefix="dsec-clhttp-", dir="/var/tmp"))
    link_downloads(home)
    # its own bridge and subnet: other dsec instances on this host keep theirs (network.py)
    n = os.getpid() % 200
    mp = pytest.MonkeyPatch()
    for k, v in {**NO_PSI_ADMISSION, "DSEC_NET_BRIDGE": f"dsech{n}", "DSEC_NET_SUBNET": f"10.86.{n}.0/24",
                 "DSEC_VM": "0", "DSEC_MEM_OVERCOMMIT": "1"}.items():   # a ceiling a test can exceed
        mp.setenv(k, v)
    paths = Paths(home)
    iam: IAM | None = None
    try:
        paths.ensure()
        ensure_builtin(ImageService(paths), "busybox")
        iam = IAM(paths.iam_db)
        iam.bootstrap(paths.admin_key_file)
        secret = secrets.token_urlsafe(32)
        settings = Settings.from_env().with_home(home)     # as the edge process reads them
        async with node_services(settings, NODE, system_project(iam)) as (edge, fncall):
            edge_sock = bind("0.0.0.0")
            edge_url = f"http://127.0.0.1:{edge_sock.getsockname()[1]}"
            edge_srv = await serve(edge_app(edge, secret, fncall), edge_sock)
            remote = HttpEdge(edge_url, secret, NODE)
            watcher = Watcher({NODE: remote}, interval_s=0.5)
            await watcher.start()
            ctx = ApiContext(iam=iam, edges={NODE: remote}, watcher=watcher, placer=Placer(k=2),
                             images=edge.images, fncall={NODE: HttpFnCall(edge_url, secret, NODE)})
            api_sock = bind("127.0.0.1")
            api_srv = await serve(create_app(ctx), api_sock)
            client = Client(f"http://127.0.0.1:{api_sock.getsockname()[1]}", paths.admin_key_file.read_text().strip())
            try:
                yield client, remote, edge_url, secret, edge_sock.getsockname()[1]
            finally:
                for sb in await edge.list():
                    await edge.stop(sb.id)
                await client.close()
                await stop(api_srv)
                await watcher.stop()
                await remote.aclose()
                await stop(edge_srv)
    finally:
        if iam is not None:
            iam.close()
        mp.undo()
        cleanup_home(home)


async def test_sandbox_lifecycle_through_http_edge(split):
    client, remote, *_ = split
    assert [n.node_id for n in await client.nodes()] == [NODE] and (await client.nodes())[0].healthy
    assert isinstance(await client.fncall_pools(), list)       # the node's FnCall service, over HTTP too
    sb = await client.create_container(image="busybox", labels={"t": "http"})
    assert sb.id.startswith(f"sb-{NODE}.")
    r = await sb.run("echo hi; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "hi\n", "err\n")
    # a stream: several chunks, then the exit event with the result
    events = [ev async for ev in sb.stream("for i in 1 2 3; do echo $i; sleep 0.1; done")]
    assert events[0].type == "start" and events[-1].type == "exit" and events[-1].result.exit_code == 0
    assert "".join(e.data or "" for e in events if e.type == "stdout") == "1\n2\n3\n"
    # files: binary bytes (base64 on the wire) both ways
    blob = bytes(range(256)) * 64
    await sb.files.write("/tmp/blob", blob)
    assert await sb.files.read("/tmp/blob") == blob
    assert "blob" in [e.name for e in await sb.files.list("/tmp")]
    await sb.files.remove("/tmp/blob")
    # a file call's user crosses to the edge (issue 24, item 4)
    await sb.files.write("/root/over-http", b"r", user="root")
    assert (await sb.run("stat -c %u:%g /root/over-http", user="root")).stdout == "0:0\n"
    with pytest.raises(NotFound) as e:
        await sb.files.read("/tmp/blob")
    assert e.value.field == "path"
    # detached exec: stdin, follow, attach
    info = await sb.start("cat; echo done", keep_stdin=True)
    await sb.send_stdin(info.exec_id, b"piped\n", close=True)
    result = await sb.attach(info.exec_id)
    assert result.stdout == "piped\ndone\n"
    followed = [ev async for ev in sb.follow(info.exec_id)]
    assert followed[-1].type == "exit"
    # suspend / resume, set_timeout, bulk by label
    assert (await sb.suspend()).state == "suspended"
    assert (await sb.run("echo back")).stdout == "back\n"      # resumed on use
    assert [(i.id, i.error) for i in await client.suspend_all({"t": "http"})] == [(sb.id, None)]
    await client.resume_all({"t": "http"})
    await sb.set_timeout(600)
    assert sb.id in [s.id for s in await client.list()]
    assert (await sb.stop()).state in ("stopped", "stopping")
    with pytest.raises(Conflict):
        await sb.run("true")


async def test_port_ingress_through_the_tunnel(split):
    client, *_ = split
    sb = await client.create_container(image="busybox")
    # a tiny HTTP server inside: busybox nc running a script per connection (reads the head, answers)
    await sb.files.write("/tmp/h.sh", HANDLER, mode=0o755)
    await sb.start("nc -ll -p 8000 -e /tmp/h.sh")
    url = f"{client.url}/v1/sandboxes/{sb.id}/ports/8000/x"
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {client._api_key}"}) as http:
        for _ in range(50):
            r = await http.get(url)
            if r.status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert r.status_code == 200 and r.text == "hello", r.text
        for _ in range(3):                       # one tunnel per request, each closed cleanly
            assert (await http.get(url)).text == "hello"
        r = await http.get(f"{client.url}/v1/sandboxes/{sb.id}/ports/8001/")
        assert r.status_code == 503 and r.json()["error"]["field"] == "port"   # nothing listens: the edge's error
    await sb.stop()


async def test_errors_cross_the_wire_as_the_same_classes(split):
    client, remote, *_ = split
    with pytest.raises(NotFound) as e:
        await client.create_container(image="no-such-image")
    assert e.value.field == "image"
    with pytest.raises(NotFound) as e:
        await remote.get(f"sb-{NODE}.0123456789ab")
    assert e.value.field == "sandbox_id" and e.value.fix
    with pytest.raises(CapacityExceeded) as e:     # admission: more memory than the node has
        from dsec.types import ContainerArgs
        await remote.create("p", ContainerArgs(image="busybox", memory_mb=256 * 1024))
    assert e.value.status == 429
    with pytest.raises(InvalidArgument):
        async with remote.port_connection(f"sb-{NODE}.0123456789ab", 0):
            pass


async def test_edge_service_refuses_callers_without_the_secret(split):
    _, _, edge_url, secret, _ = split
    async with httpx.AsyncClient() as http:
        for headers in ({}, {"Authorization": "Bearer " + "x" * len(secret)}, {"Authorization": secret},
                        {"Authorization": f"Basic {secret}"}):
            r = await http.post(f"{edge_url}/v1/edge/list", json={"project": None, "include_ended": True}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", headers
        r = await http.post(f"{edge_url}/v1/edge/status", content=b"{}", headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 200 and r.json()["result"]["node_id"] == NODE
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus
    with pytest.raises(InvalidStatus):            # the tunnel's handshake is refused too
        await connect(edge_url.replace("http", "ws") + "/v1/tunnel?sandbox_id=x&port=1")


async def test_sandbox_cannot_use_its_nodes_edge_service(split):
    """Containment: even with a policy that allows the bridge gateway and the host's address,
    the edge service's port is not reachable from a sandbox (host firewall), and a caller that
    could reach it would still need the cluster secret (previous test)."""
    client, _, _, _, edge_port = split
    gateway = os.environ["DSEC_NET_SUBNET"].rsplit(".", 1)[0] + ".1"
    me = host_ip()
    sb = await client.create_container(image="busybox", network={
        "rules": [{"cidr": f"{gateway}/32"}, {"cidr": f"{me}/32"}]})
    for addr in (gateway, me, "127.0.0.1"):
        r = await sb.run(f"printf 'POST /v1/edge/list HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {addr} {edge_port}; echo rc=$?",
                         timeout_s=30)
        assert "HTTP/" not in r.stdout and "rc=0" not in r.stdout, (addr, r)
    await sb.stop()


async def test_a_stopped_edge_is_unavailable_and_unhealthy(split):
    """Last in the module: the node's edge service goes away; calls are 503, the watcher marks it."""
    client, remote, *_ = split
    from dsec.cluster.edge_client import HttpEdge
    dead = HttpEdge("http://127.0.0.1:1", "s" * 43, NODE)
    with pytest.raises(Unavailable) as e:
        await dead.status()
    assert e.value.status == 503 and NODE in e.value.message
    await dead.aclose()


async def test_node_metrics_and_usage_through_http_edge(split):
    """Each edge's metrics are reachable through the apiserver at /v1/nodes/{node}/metrics
    (the metrics_text verb over the wire); a sandbox's usage crosses it too."""
    client, *_ = split
    sb = await client.create_container(image="busybox")
    try:
        await sb.run("true")
        assert (await sb.metrics())[-1].mem_total == sb.info.memory_mb << 20
        r = await client._request("GET", f"/v1/nodes/{NODE}/metrics")
        assert f'dsec_sandboxes{{backend="container",node="{NODE}"' in r.text
        assert "dsec_sandbox_create_seconds_bucket" in r.text
    finally:
        await sb.stop()


async def test_lifecycle_events_through_http_edge(split):
    """The apiserver pulls a remote edge's lifecycle events (the events_since verb over the
    wire) into the control store, and a request to an ended sandbox carries its end reason
    across it (EndedByUser, reason killed)."""
    from dsec.testing.waiting import wait_until
    from dsec.types import EndedByUser, EventType
    client, *_ = split
    sb = await client.create_container(image="busybox")
    await sb.stop()

    async def both():
        evs = (await client.events(sandbox_id=sb.id)).events
        return evs if [e.type for e in evs] == [EventType.created, EventType.ended] else None
    evs = await wait_until(both, timeout_s=30, what="created and ended through the HTTP edge")
    assert evs[1].node == NODE and evs[1].reason == "killed", evs
    with pytest.raises(EndedByUser) as exc:
        await sb.run("true")
    assert exc.value.reason == "killed"


async def test_warm_pools_through_http_edge(split):
    """A cluster node's warm pools are set and read through the apiserver's admin route over the
    edge's wire (before, the route answered 404: the HTTP edge had no warm-pool verbs); a create
    is answered from the pool and the pool drains when set to none."""
    client, *_ = split
    pools = await client.set_warm_pools("busybox:1", node=NODE, auto=0)
    assert pools.pools["busybox"].size == 1 and pools.auto_max == 0
    for _ in range(120):
        st = (await client.warm_pools(node=NODE)).pools["busybox"]
        if st.idle == 1 and st.starting == 0:
            break
        await asyncio.sleep(0.5)
    else:
        pytest.fail(f"the pool did not fill: {st}")
    claims = (await client.warm_pools(node=NODE)).claims
    sb = await client.create_container(image="busybox")
    try:
        assert (await sb.run("echo warm")).stdout == "warm\n"
        assert (await client.warm_pools(node=NODE)).claims == claims + 1
    finally:
        await sb.stop()
    assert (await client.set_warm_pools("", node=NODE)).pools == {}
    with pytest.raises(NotFound) as e:
        await client.warm_pools(node="no-such-node")
    assert e.value.field == "node"
