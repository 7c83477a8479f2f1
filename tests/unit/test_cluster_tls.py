"""TLS between replicas and edges (dsec.cluster.cluster_ca): a real edge (on the fake backend)
served by edge_service over TLS with a certificate the cluster CA issued for its node name;
HttpEdge verifies it against the CA and that name. Plain HTTP to it is refused, a replica with
another CA (or an edge with another node's certificate) fails naming the setting."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import httpx
import pytest

pytest.importorskip("websockets", reason="cluster mode's tunnel client: pip install -e '.[cluster]'")

from dsec.cluster import cluster_ca  # noqa: E402
from dsec.cluster.edge_client import HttpEdge  # noqa: E402
from dsec.cluster.edge_service import bind, edge_app, serve, stop  # noqa: E402
from dsec.cluster.wire import EdgeUnreachable  # noqa: E402
from dsec.types import InvalidArgument, NotFound  # noqa: E402

NODE = "n1"


@pytest.fixture
async def tls_edge(edge, short_tmp: Path):
    """(https URL, secret, cluster home) of the edge served with its node certificate."""
    home = short_tmp / "cluster"
    pem = cluster_ca.issue(home, NODE, ["127.0.0.1"])
    tls_file = short_tmp / "nodes" / NODE / cluster_ca.EDGE_TLS
    cluster_ca.install(tls_file, pem)
    secret = secrets.token_urlsafe(32)
    sock = bind("127.0.0.1")
    server = await serve(edge_app(edge, secret), sock, str(tls_file))
    try:
        yield f"https://127.0.0.1:{sock.getsockname()[1]}", secret, home
    finally:
        await stop(server)


def _client(url: str, secret: str, ca_home: Path, node: str = NODE) -> HttpEdge:
    ca_file = ca_home / cluster_ca.CA_CERT
    cluster_ca.ensure_ca(ca_home)
    return HttpEdge(url, secret, node, tls=cluster_ca.client_context(ca_file), ca_file=str(ca_file))


async def test_replica_verifies_the_edge_and_calls_it(tls_edge):
    url, secret, home = tls_edge
    remote = _client(url, secret, home)
    try:
        assert (await remote.status()).node_id        # verified and answered
        assert await remote.list() == []
        with pytest.raises(NotFound):        # the tunnel (WebSocket over TLS) reaches the edge too
            async with remote.port_connection("sb-n1.nope", 80):
                pass
    finally:
        await remote.aclose()


async def test_files_are_private_where_they_hold_keys(tls_edge, short_tmp):
    _, _, home = tls_edge
    for f in (home / cluster_ca.CA_KEY, short_tmp / "nodes" / NODE / cluster_ca.EDGE_TLS):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    assert b"PRIVATE KEY" not in (home / cluster_ca.CA_CERT).read_bytes()


async def test_plain_http_is_refused(tls_edge):
    url, secret, _ = tls_edge
    plain = url.replace("https://", "http://")
    async with httpx.AsyncClient(timeout=10) as http:
        with pytest.raises(httpx.TransportError):       # the TLS handshake fails: nothing is read
            await http.post(plain + "/v1/edge/list", headers={"Authorization": f"Bearer {secret}"}, json={})
    remote = HttpEdge(plain, secret, NODE)
    try:
        with pytest.raises(EdgeUnreachable):
            await remote.list()
    finally:
        await remote.aclose()


async def test_another_ca_fails_naming_the_setting(tls_edge, short_tmp):
    url, secret, _ = tls_edge
    remote = _client(url, secret, short_tmp / "other-cluster")
    try:
        with pytest.raises(EdgeUnreachable) as e:
            await remote.status()
        assert e.value.field == "cluster_ca" and "other-cluster" in e.value.message and e.value.fix
        assert "certificate" in e.value.message and not e.value.delivered
        with pytest.raises(EdgeUnreachable) as e:     # the tunnel as well
            async with remote.port_connection("sb-n1.nope", 80):
                pass
        assert e.value.field == "cluster_ca"
    finally:
        await remote.aclose()


async def test_a_certificate_of_another_node_is_refused(tls_edge):
    url, secret, home = tls_edge
    remote = _client(url, secret, home, node="n2")     # the address of n1, expected to be n2
    try:
        with pytest.raises(EdgeUnreachable) as e:
            await remote.status()
        assert e.value.field == "cluster_ca"
    finally:
        await remote.aclose()


def test_https_edge_without_a_ca_is_refused():
    with pytest.raises(InvalidArgument) as e:
        HttpEdge("https://127.0.0.1:1", "x" * 32, NODE)
    assert e.value.field == "cluster_ca"


def test_a_missing_ca_file_names_the_fix(short_tmp):
    from dsec.types import Unavailable
    with pytest.raises(Unavailable) as e:
        cluster_ca.client_context(short_tmp / "nope.pem")
    assert e.value.field == "cluster_ca" and "cluster up" in (e.value.fix or "")
