"""The small PKI pieces dsec's own CAs share (the ingress CA of apiserver/tls.py, the cluster CA
of cluster/cluster_ca.py, the egress CA of security/egress_ca.py): atomic private writes and a
self-signed P-256 CA kept in two files."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Write atomically with `mode` from the first byte (a key is never readable, even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def load_or_make_ca(cert_path: Path, key_path: Path, common_name: str, days: int, *,
                    subject: x509.Name | None = None, digital_signature: bool = False
                    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA kept at cert_path/key_path, made on first use (its name gets a random suffix, so
    two installations' CAs are told apart). `subject`: that name instead (the egress CA's names
    its node); `digital_signature`: the key usage bit besides certificate and CRL signing (the
    egress CA has always carried it; kept so its certificates stay as they were)."""
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    name = subject or x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "dsec"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name} {os.urandom(4).hex()}")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=digital_signature, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    write_file(key_path, key_pem(key), 0o600)
    write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def server_leaf(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str,
                names: list[x509.GeneralName], days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A fresh P-256 key and a TLS server certificate for it, signed by the CA, valid for `names`."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert
