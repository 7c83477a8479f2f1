"""Egress by name without root: domain patterns, the proxy's SNI/Host parsing, the kernel
allow-list a policy becomes, and E2B's allowOut/denyOut mapping."""

from __future__ import annotations

import ssl

import pytest

from dsec.apiserver.e2b.errors import Unsupported
from dsec.apiserver.e2b.mapping import network_policy
from dsec.backends.container.egress_proxy import host_of, sni_of
from dsec.security.netpolicy import ANY4, Allow, allows_of_domains, compile_allows, kernel_allows
from dsec.types.domains import matches, pattern_error


def test_patterns_match_whole_labels():
    pats = ["pypi.org", "*.githubusercontent.com"]
    assert matches("PyPI.org.", pats) and matches("raw.githubusercontent.com", pats)
    assert matches("a.b.githubusercontent.com", pats)
    assert not matches("githubusercontent.com", pats)         # a wildcard does not cover its apex
    assert not matches("evilpypi.org", pats) and not matches("pypi.org.evil.test", pats)
    assert not matches("xgithubusercontent.com", pats)
    for bad in ("a.*.com", "*", "*.com*", "1.2.3.4", "under_score.test", "-lead.test", "single"):
        assert pattern_error(bad), bad
    assert pattern_error("*.example.com") is None and pattern_error("xn--bcher-kva.test") is None


def _client_hello(name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_sni_and_host_are_read_from_the_first_bytes():
    hello = _client_hello("allowed.test")
    assert sni_of(hello) == "allowed.test"
    assert sni_of(hello[:20]) is False                        # more bytes needed
    assert sni_of(_client_hello(None)) is None
    with pytest.raises(ValueError):
        sni_of(b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00")   # a handshake, not a ClientHello
    assert host_of(b"GET / HTTP/1.1\r\nHost: a.test:8080\r\nX: y\r\n\r\n") == "a.test"
    assert host_of(b"GET / HTTP/1.1\r\nhost:b.test\r\n\r\n") == "b.test"
    assert host_of(b"GET / HTTP/1.1\r\nHost: a.test") is False
    assert host_of(b"GET / HTTP/1.1\r\n\r\n") is None


def test_kernel_allows_add_dns_with_any_egress_and_80_443_with_names():
    assert kernel_allows([]) == []
    cidr = [Allow("10.0.0.0/8", 22, 22, 1)]
    assert Allow(ANY4, 53, 53, 3) in kernel_allows(cidr) and Allow(ANY4, 443, 443, 1) not in kernel_allows(cidr)
    named = kernel_allows(allows_of_domains(["pypi.org"]))
    assert {(a.lo, a.protos) for a in named} == {(53, 3), (80, 1), (443, 1)}
    assert all(not a.is_domain for a in named)
    compile_allows(allows_of_domains(["pypi.org"]) + cidr)   # domain entries are not networks


def test_e2b_allow_out_takes_names_and_deny_out_only_networks():
    assert network_policy({"allowOut": ["pypi.org", "1.2.3.4"], "denyOut": ["0.0.0.0/0"]}, True) == \
        {"rules": [{"cidr": "1.2.3.4/32"}], "domains": ["pypi.org"]}
    assert network_policy({"denyOut": ["0.0.0.0/0"]}, True) is None
    assert network_policy({"dnsServers": ["8.8.8.8"]}, False) is None
    with pytest.raises(Unsupported, match="network.denyOut"):
        network_policy({"denyOut": ["pypi.org"]}, True)
    with pytest.raises(Unsupported, match="network.egressProxy.tls"):
        network_policy({"egressProxy": {"address": "x:1", "tls": True}}, True)


def test_a_project_held_to_some_networks_cannot_allow_names():
    from dsec.iam.policy import SandboxPolicy, check_network
    from dsec.types import Forbidden, NetworkPolicy
    check_network(SandboxPolicy(), NetworkPolicy(domains=["pypi.org"]), "p")        # no ceiling: fine
    with pytest.raises(Forbidden) as e:
        check_network(SandboxPolicy(cidrs=["10.0.0.0/8"]), NetworkPolicy(domains=["pypi.org"]), "p")
    assert e.value.field == "network.domains"
