"""TLS between apiserver replicas and edges: a cluster CA and one server certificate per node.

`dsec cluster up` keeps the CA in its home (cluster-ca.pem, cluster-ca.key 0600: the key never
leaves the machine that ran `up`), installs the CA certificate on every live node as
<node-homes>/cluster-ca.pem, and issues each node's edge a certificate for its node name (plus
the addresses it is known by) into <node-homes>/<name>/edge-tls.pem (key and chain, 0600),
re-issued at every `up`. Replicas verify an edge against the CA and against the name of the node
they expect (SNI and hostname check on the node name, whatever address the edge serves on: a
raylet that came back on a new address still proves it is that node); the bearer secret is still
sent (secret_file.py). EC P-256 keys: made in milliseconds.
"""

from __future__ import annotations

import ipaddress
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from dsec.security.pki import key_pem as _key_pem, load_or_make_ca, server_leaf, write_file as _write
from dsec.types import Unavailable

CA_CERT = "cluster-ca.pem"       # in the cluster home, and in <node-homes> on every node
CA_KEY = "cluster-ca.key"        # in the cluster home only
EDGE_TLS = "edge-tls.pem"        # in <node-homes>/<name>: key + certificate
CA_DAYS = 3650
LEAF_DAYS = 825                  # re-issued at every `up`


def ensure_ca(home: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The cluster CA kept in `home` (made on first use)."""
    return load_or_make_ca(home / CA_CERT, home / CA_KEY, "dsec cluster CA", CA_DAYS)


def ca_pem(home: Path) -> bytes:
    return ensure_ca(home)[0].public_bytes(serialization.Encoding.PEM)


def issue(home: Path, node: str, addresses: list[str]) -> bytes:
    """A server certificate for `node`'s edge (its name, and the addresses given), signed by the
    CA in `home`: key + certificate + CA, one PEM (what uvicorn's ssl_certfile loads alone)."""
    ca_cert, ca_key = ensure_ca(home)
    names: list[x509.GeneralName] = [x509.DNSName(node)]
    for a in dict.fromkeys(addresses):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(a)))
        except ValueError:
            if a and a != node:
                names.append(x509.DNSName(a))
    key, cert = server_leaf(ca_cert, ca_key, node, names, LEAF_DAYS)
    return _key_pem(key) + cert.public_bytes(serialization.Encoding.PEM) + \
        ca_cert.public_bytes(serialization.Encoding.PEM)


def install(path: Path | str, data: bytes, mode: int = 0o600) -> None:
    """Write a certificate file atomically (readers see the old one or the new one, whole)."""
    _write(Path(path), data, mode)


def client_context(ca_file: Path | str) -> ssl.SSLContext:
    """What a replica verifies edges with: only the cluster CA, hostname checked (against the
    node name, given as the server_hostname / sni_hostname of each connection)."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
    except (OSError, ssl.SSLError) as e:
        raise Unavailable(f"the cluster CA file {ca_file} cannot be read on this node ({e})", field="cluster_ca",
                          fix="run `dsec cluster up` (it installs <node-homes>/cluster-ca.pem on every live "
                              "node)") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def verify_failure(e: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification error somewhere in `e`'s chain, if that is what failed."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ssl.SSLCertVerificationError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None
