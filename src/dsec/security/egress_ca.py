"""The node's egress CA: certificates the egress proxy presents for destinations it adds a
secret to (issue 30, docs/security.md "Secrets added at the egress proxy").

One CA per node (DSEC_HOME/egress-ca/: ca.key 0600, ca.pem), made on first use with the
`cryptography` package. Only sandboxes with secret rules trust it: the bundle (the host's
public roots + this CA) is bound read-only into them and named by SSL_CERT_FILE & co. Leaf
certificates (EC P-256, 7 days) are minted per name in memory and cached; their keys never
touch the disk. The CA key never enters a sandbox (it is not under any bound directory).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dsec.security.pki import load_or_make_ca

HOST_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
LEAF_DAYS = 7
CA_DAYS = 3650
# where the bundle is bound in a sandbox, and the variables that name it
BUNDLE_IN_SANDBOX = "/etc/dsec/egress-ca-bundle.pem"
TRUST_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE")


def trust_env() -> dict[str, str]:
    """What a sandbox with secret rules gets in its environment: paths, never secrets."""
    return {k: BUNDLE_IN_SANDBOX for k in TRUST_ENV}


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class EgressCA:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._lock = threading.Lock()
        self._contexts: dict[str, ssl.SSLContext] = {}
        self.key, self.cert = self._load_or_make()

    def _load_or_make(self) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        if not (self.dir / "ca.key").exists():
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.dir, 0o700)
        cert, key = load_or_make_ca(self.dir / "ca.pem", self.dir / "ca.key", "dsec egress CA", CA_DAYS,
                                    subject=_name(f"dsec egress CA {os.uname().nodename}"[:64]),
                                    digital_signature=True)
        return key, cert

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def bundle(self) -> Path:
        """The host's public roots followed by this CA (bound into sandboxes with secrets)."""
        path = self.dir / "bundle.pem"
        roots = b""
        for p in HOST_BUNDLES:
            if os.path.exists(p):
                roots = Path(p).read_bytes()
                break
        text = roots.rstrip(b"\n") + b"\n" + self.cert_pem if roots else self.cert_pem
        if not path.exists() or path.read_bytes() != text:
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(text)
            tmp.chmod(0o644)
            tmp.replace(path)
        return path

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for `host` (cached per name)."""
        with self._lock:
            ctx = self._contexts.get(host)
            if ctx is None:
                ctx = self._contexts[host] = self._mint(host)
            return ctx

    def _mint(self, host: str) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        cert = (x509.CertificateBuilder().subject_name(_name(host[:64])).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName([san]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])   # the proxy speaks HTTP/1.1 to the sandbox
        # ssl loads chains only from files: a private temporary file, removed at once
        with tempfile.NamedTemporaryFile(dir=self.dir, prefix=".leaf-", suffix=".pem") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
            f.flush()
            ctx.load_cert_chain(f.name)
        return ctx
