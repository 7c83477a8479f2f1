"""The parts of E2B's egress_proxy (issue 30 item 3) that need no sandbox: the SOCKS5 client
against a real asyncio server, the tunnel entry of the allow-list, the E2B mapping, the
password kept out of the stored args, and the project ceiling."""

from __future__ import annotations

import asyncio
import struct

import pytest

from dsec.apiserver.e2b.errors import Unsupported
from dsec.apiserver.e2b.mapping import check_kept_proxy, network_policy
from dsec.apiserver.egress_secrets import _socks_credentials
from dsec.backends.container.socks5 import SocksRefused, socks_connect, split_address
from dsec.iam.policy import SandboxPolicy, check_network
from dsec.security.netpolicy import Rulesets, compile_allows, egress_allows, kernel_allows, resolve, tunnel_of
from dsec.types import ContainerArgs, Forbidden, NetworkPolicy


async def _server(users: dict[str, str] | None, reply: int = 0):
    """A minimal SOCKS5 server: records (user, atyp, target, port) of each CONNECT."""
    seen: list[tuple] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            _, n = await r.readexactly(2)
            methods = await r.readexactly(n)
            user = None
            if users is not None:
                if 2 not in methods:
                    w.write(b"\x05\xff")
                    return
                w.write(b"\x05\x02")
                await r.readexactly(1)
                user = (await r.readexactly((await r.readexactly(1))[0])).decode()
                pw = (await r.readexactly((await r.readexactly(1))[0])).decode()
                if users.get(user) != pw:
                    w.write(b"\x01\x01")
                    return
                w.write(b"\x01\x00")
            else:
                w.write(b"\x05\x00")
            _, _, _, atyp = await r.readexactly(4)
            target = (await r.readexactly(4)) if atyp == 1 else await r.readexactly((await r.readexactly(1))[0])
            port = struct.unpack(">H", await r.readexactly(2))[0]
            seen.append((user, atyp, target, port))
            w.write(bytes([5, reply, 0, 3, 4]) + b"host" + b"\x00\x50")   # a by-name bound address
            await w.drain()
            if reply == 0:
                w.write(await r.readexactly(5))   # echo
                await w.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], seen


async def _dial(port: int, target: str, dport: int, auth):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        await socks_connect(r, w, target, dport, auth)
        w.write(b"hello")
        return await r.readexactly(5)
    finally:
        w.close()


async def test_socks5_connect_by_address_and_by_name_with_and_without_credentials():
    srv, port, seen = await _server(None)
    async with srv:
        assert await _dial(port, "10.1.2.3", 80, None) == b"hello"
        assert await _dial(port, "api.example.test", 443, None) == b"hello"
    assert seen == [(None, 1, bytes([10, 1, 2, 3]), 80), (None, 3, b"api.example.test", 443)]
    srv, port, seen = await _server({"u": "pw"})
    async with srv:
        assert await _dial(port, "a.test", 8080, ("u", "pw")) == b"hello"
        with pytest.raises(SocksRefused, match="rejected"):
            await _dial(port, "a.test", 8080, ("u", "bad"))
        with pytest.raises(SocksRefused, match="no credentials"):
            await _dial(port, "a.test", 8080, None)
    assert seen == [("u", 3, b"a.test", 8080)]
    srv, port, seen = await _server(None, reply=5)
    async with srv:
        with pytest.raises(SocksRefused, match="connection refused"):
            await _dial(port, "a.test", 22, None)
    assert split_address("proxy.test:1080") == ("proxy.test", 1080)


def test_tunnel_entry_opens_nothing_by_itself(tmp_path):
    pol = NetworkPolicy(rules=[{"cidr": "10.0.0.0/8", "ports": [22]}],
                        egress_proxy={"address": "Proxy.Test:1080", "username": "u", "password": "p"})
    allows = resolve(pol, Rulesets(tmp_path / "none.json"))
    assert tunnel_of(allows) == "proxy.test:1080"
    assert tunnel_of(egress_allows(allows)) is None
    assert [(a.cidr, a.protos) for a in kernel_allows(allows)] == [("10.0.0.0/8", 1), ("0.0.0.0/0", 3)]  # TCP; DNS
    e2b = resolve(NetworkPolicy(rules=[{"cidr": "0.0.0.0/0"}, {"cidr": "::/0"}, {"cidr": "1.2.3.4", "protocol": "udp"}],
                                egress_proxy={"address": "p.test:1"}), Rulesets(tmp_path / "none.json"))
    assert [(a.cidr, a.protos) for a in kernel_allows(e2b)] == [("0.0.0.0/0", 1), ("0.0.0.0/0", 3)]  # no UDP, no v6
    only = resolve(NetworkPolicy(egress_proxy={"address": "p.test:1"}), Rulesets(tmp_path / "none.json"))
    assert kernel_allows(only) == [] and compile_allows(only) == {}                # no DNS, no egress
    with pytest.raises(ValueError, match="password"):
        NetworkPolicy(egress_proxy={"address": "p.test:1", "password": "x"})
    with pytest.raises(ValueError, match="1-65535"):
        NetworkPolicy(egress_proxy={"address": "p.test:0"})


def test_e2b_egress_proxy_mapping_and_updates():
    pol = network_policy({"egressProxy": {"address": "p.test:1080", "username": "u", "password": "pw"}}, True,
                         rules_ok=True)
    assert pol["egress_proxy"] == {"address": "p.test:1080", "username": "u", "password": "pw"}
    assert pol["rules"] == [{"cidr": "0.0.0.0/0"}, {"cidr": "::/0"}]
    put = network_policy({"egressProxy": {"address": "p.test:1080", "username": "u", "password": "pw"}}, True)
    assert put["egress_proxy"] == {"address": "p.test:1080", "username": "u"}   # an update takes no password
    current = NetworkPolicy.model_validate(pol)
    check_kept_proxy(put, current)                  # the same proxy repeated: fine
    check_kept_proxy(network_policy({}, True), current)   # omitted: kept by the edge
    for cur in (current, None):
        with pytest.raises(Unsupported) as e:
            check_kept_proxy(network_policy({"egressProxy": {"address": "q.test:1"}}, True), cur)
        assert e.value.field == "network.egressProxy"


def test_password_never_stays_in_the_args_and_restricted_projects_cannot_name_a_proxy():
    args = ContainerArgs(image="x", network={"rules": [{"cidr": "1.2.3.4"}],
                                             "egress_proxy": {"address": "p.test:1", "username": "u",
                                                              "password": "pw"}})
    stripped, rules = _socks_credentials(args)
    assert stripped.network.egress_proxy.password is None and "pw" not in stripped.model_dump_json()
    assert [(r.kind, r.auth) for r in rules] == [("socks5", ["u", "pw"])]
    assert _socks_credentials(ContainerArgs(image="x"))[1] == []
    check_network(SandboxPolicy(), args.network, "p")
    for ceiling in (SandboxPolicy(cidrs=["1.0.0.0/8"]), SandboxPolicy(egress="rulesets")):
        with pytest.raises(Forbidden) as e:
            check_network(ceiling, NetworkPolicy(egress_proxy={"address": "p.test:1"}), "p")
        assert e.value.field == "network.egress_proxy"
