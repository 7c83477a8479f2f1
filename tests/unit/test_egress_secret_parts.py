"""Parts of the egress secrets (issue 30) without a sandbox: the request rewrite, the rules'
matching and revocation, the encrypted store, the node CA's leaves, the proxy's TLS
termination over a stream whose ClientHello was already read, and E2B's rules mapping."""

from __future__ import annotations

import asyncio
import ssl

import pytest
from pydantic import ValidationError

from dsec.apiserver.e2b.errors import Unsupported
from dsec.apiserver.e2b.mapping import network_policy, transform_rules
from dsec.backends.container.secret_rules import SecretRules
from dsec.backends.container.tls_intercept import ServerTLS, rewrite_head
from dsec.iam.secrets import SecretStore
from dsec.security.egress_ca import EgressCA
from dsec.store.migrate import open_db
from dsec.types import EgressSecret, InvalidArgument, SecretCreate


def test_rewrite_sets_the_rule_headers_once_and_closes():
    head = b"GET /v1 HTTP/1.1\r\nHost: api.test\r\nx-api-key: mine\r\nConnection: keep-alive\r\n\r\n"
    out = rewrite_head(head, "api.test", {"X-Api-Key": "S"})
    assert isinstance(out, bytes)
    assert out.lower().count(b"x-api-key") == 1 and b"X-Api-Key: S\r\n" in out and out.endswith(b"Connection: close\r\n\r\n")
    assert b"keep-alive" not in out


@pytest.mark.parametrize("head,status", [
    (b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n", "421"),                 # another name than the SNI
    (b"GET / HTTP/1.1\r\n\r\n", "421"),                                     # no Host
    (b"GET http://other.test/ HTTP/1.1\r\nHost: api.test\r\n\r\n", "400"),  # absolute URI
    (b"GET / HTTP/1.1\r\nHost: api.test\r\n X-Folded: 1\r\n\r\n", "400"),   # obs-fold
    (b"GET / HTTP/1.1\r\nHost: api.test\r\nHost: other.test\r\n\r\n", "400"),
])
def test_rewrite_refuses_requests_the_secret_is_not_for(head, status):
    out = rewrite_head(head, "api.test", {"X-Api-Key": "S"})
    assert isinstance(out, str) and out.startswith(status)


def test_rules_match_by_whole_name_and_port_and_revoke_everywhere():
    r = SecretRules()
    rule = EgressSecret(id="sec_1", hosts=["api.test", "*.cdn.test"], headers={"X": "v"})
    r.set("a", [rule])
    r.set("b", [rule])
    assert r.match("a", "api.test", 443) and r.match("a", "x.cdn.test", 443)
    assert not r.match("a", "evilapi.test", 443) and not r.match("a", "cdn.test", 443)
    assert not r.match("a", "api.test", 80) and not r.match("c", "api.test", 443)
    assert r.revoke("sec_1") == 2 and not r.match("a", "api.test", 443) and not r.match("b", "api.test", 443)
    assert r.has("a")   # still in the proxy's set: its other TLS passes untouched


def test_rules_prefer_the_exact_name_then_the_longest_wildcard():
    r = SecretRules()
    wide, narrow, exact = (EgressSecret(id=i, hosts=[h], headers={"X": i})
                           for i, h in (("wide", "*.test"), ("narrow", "*.api.test"), ("exact", "v1.api.test")))
    r.set("a", [wide, narrow, exact])
    assert r.match("a", "v1.api.test", 443).id == "exact"
    assert r.match("a", "v2.api.test", 443).id == "narrow"
    assert r.match("a", "other.test", 443).id == "wide"


def test_secret_create_names_the_field():
    ok = dict(name="k", value="v", hosts=["API.test."], header="X-K")
    assert SecretCreate(**ok).hosts == ["api.test"]
    for bad, field in ((dict(ports=[80]), "ports"), (dict(header=None), "header"), (dict(value="a\r\nb"), "value"),
                       (dict(name="e2b.x"), "name"), (dict(header=None, basic_auth=True, value="nocolon"), "value")):
        with pytest.raises(ValidationError) as e:
            SecretCreate(**{**ok, **bad})
        assert field in str(e.value)


def test_store_keeps_values_encrypted_and_returns_them_only_as_rules(tmp_path):
    db = open_db(tmp_path / "iam.db")
    db.run(lambda tx: tx.execute("INSERT INTO projects (id, name, parent_id, max_sandboxes, max_cpu_cores, "
                                 "max_memory_mb, created_at) VALUES ('p', 'p', NULL, 1, 1, 1, 0)"))
    st = SecretStore(db, tmp_path / "secrets.key")
    info = st.create("p", SecretCreate(name="k", value="S3CRET-VALUE", hosts=["api.test"], basic_auth=False,
                                       header="X-K"))
    assert "S3CRET" not in info.model_dump_json() and "S3CRET" not in str(st.list("p"))
    assert b"S3CRET-VALUE" not in (tmp_path / "iam.db").read_bytes()
    assert (tmp_path / "secrets.key").stat().st_mode & 0o777 == 0o600
    assert st.rules("p", ["k"])[0].headers == {"X-K": "S3CRET-VALUE"}
    with pytest.raises(InvalidArgument) as e:
        st.rules("p", ["k", "missing"])
    assert e.value.field == "secrets[1]"
    db.close()


def test_ca_leaf_verifies_and_tls_terminates_after_the_hello_was_read(tmp_path):
    ca = EgressCA(tmp_path / "ca")
    assert (tmp_path / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    assert b"PRIVATE" not in ca.bundle().read_bytes()
    client_ctx = ssl.create_default_context(cafile=str(tmp_path / "ca" / "ca.pem"))

    async def go() -> bytes:
        async def serve(reader, writer):
            head = await reader.read(16384)          # the proxy has read the ClientHello
            tls = ServerTLS(reader, writer, ca.server_context("api.test"))
            tls.feed(head)
            await tls.handshake()
            data = await tls.read()
            await tls.write(b"echo:" + data)
            await tls.close()
            writer.close()
        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx, server_hostname="api.test")
        w.write(b"hello")
        await w.drain()
        out = await r.read(100)
        w.close()
        srv.close()
        return out
    assert asyncio.run(go()) == b"echo:hello"


def test_e2b_rules_map_to_sandbox_secrets_and_the_rest_is_refused_by_name():
    net = {"allowOut": ["api.test"], "rules": {"api.test": [{"transform": {"headers": {"Authorization": "Bearer S"}}}]}}
    [rule] = transform_rules(net)
    assert rule.hosts == ["api.test"] and rule.headers == {"Authorization": "Bearer S"} and rule.kind == "inline"
    assert network_policy(net, None, rules_ok=True) == {"rules": [], "domains": ["api.test"]}
    for bad, field in (({"rules": {"10.0.0.1": [{"transform": {"headers": {"A": "b"}}}]}}, "network.rules.10.0.0.1"),
                       ({"rules": {"a.test": [{"transform": {"headers": {"A": "${e2b.identity.tokens.x}"}}}]}},
                        "network.rules.a.test.transform.headers.A")):
        with pytest.raises(Unsupported) as e:
            transform_rules(bad)
        assert e.value.field == field
    with pytest.raises(Unsupported) as e:
        network_policy({"egressProxy": {"address": "p:1080", "dial": 1}}, None)
    assert e.value.field == "network.egressProxy.dial"
    with pytest.raises(Unsupported) as e:
        network_policy(net, None)                     # PUT .../network: rules at create only
    assert e.value.field == "network.rules"


def _upstream_ca(tmp_path):
    """A local 'public' CA and a TLS server context for api.test signed by it."""
    import datetime
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(cn, key, issuer, issuer_key, ca):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1)))
        b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True) if ca else \
            b.add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = cert("test CA", ca_key, name, ca_key, True)
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = cert("api.test", key, name, ca_key, False)
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM)   # noqa: E731
    (tmp_path / "upca.pem").write_bytes(pem(ca))
    (tmp_path / "up.pem").write_bytes(pem(leaf) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(tmp_path / "up.pem"))
    return str(tmp_path / "upca.pem"), ctx


@pytest.mark.parametrize("trusted", [True, False])
def test_intercept_adds_the_header_relays_the_body_and_never_sends_to_an_unverified_upstream(tmp_path, trusted):
    from dsec.backends.container.tls_intercept import intercept, upstream_context
    ca_file, up_ctx = _upstream_ca(tmp_path)
    node_ca = EgressCA(tmp_path / "node-ca")
    rule = EgressSecret(id="s", hosts=["api.test"], headers={"X-Api-Key": "S3CRET"})
    seen: list[bytes] = []

    async def go() -> bytes:
        async def upstream(reader, writer):
            data = b""
            while b"\r\n\r\n" not in data or not data.endswith(b"hello body"):
                chunk = await reader.read(65536)
                if not chunk:
                    break
                data += chunk
            seen.append(data)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            await writer.drain()
            writer.close()
        up = await asyncio.start_server(upstream, "127.0.0.1", 0, ssl=up_ctx)
        up_port = up.sockets[0].getsockname()[1]

        async def proxy(reader, writer):
            head = await reader.read(16384)
            try:
                await intercept(head, reader, writer, "api.test", up_port, ["127.0.0.1"], node_ca.server_context,
                                upstream_context(ca_file if trusted else ""), lambda: rule, "sb")
            finally:
                writer.close()
        px = await asyncio.start_server(proxy, "127.0.0.1", 0)
        client_ctx = ssl.create_default_context(cafile=str(tmp_path / "node-ca" / "ca.pem"))
        try:
            r, w = await asyncio.open_connection("127.0.0.1", px.sockets[0].getsockname()[1], ssl=client_ctx,
                                                 server_hostname="api.test")
            w.write(b"POST /v1 HTTP/1.1\r\nHost: api.test\r\nX-Api-Key: mine\r\nContent-Length: 10\r\n\r\nhello body")
            await w.drain()
            out = await asyncio.wait_for(r.read(), 10)
            w.close()
            return out
        except (ssl.SSLError, ConnectionError):
            return b"closed"
        finally:
            px.close()
            up.close()
    out = asyncio.run(go())
    if trusted:
        assert out.endswith(b"\r\n\r\nok"), out
        [req] = seen
        assert b"X-Api-Key: S3CRET\r\n" in req and b"mine" not in req and req.endswith(b"\r\n\r\nhello body")
        assert b"Connection: close" in req
    else:
        assert out in (b"closed", b"") and seen == [], (out, seen)   # the destination got nothing


def test_egress_ca_made_by_pki_keeps_its_name_usage_and_modes(tmp_path):
    """The egress CA comes from security/pki.py like the ingress and cluster CAs, with what it
    always had: a subject naming the node, digitalSignature among its key usages, a 0700 dir,
    a 0600 key; made once, then loaded (the same certificate at the next start)."""
    import os

    from cryptography import x509

    ca = EgressCA(tmp_path / "ca")
    assert ca.cert.subject.rfc4514_string() == f"CN=dsec egress CA {os.uname().nodename}"[:67]
    usage = ca.cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and usage.key_cert_sign and usage.crl_sign
    assert ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert (tmp_path / "ca").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    assert EgressCA(tmp_path / "ca").cert == ca.cert
