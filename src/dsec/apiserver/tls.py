"""The HTTPS certificate of `{port}-{id}.{domain}` (DSEC_DOMAIN): the operator's, or one dsec signs.

With DSEC_TLS_CERT/DSEC_TLS_KEY the operator's wildcard certificate is used as given, after a
check that it names `*.<domain>` (a certificate for another name would fail in every client,
so it is refused at start, naming the variable). Without them dsec keeps a CA of its own in
DSEC_HOME/tls/ (ca.pem is what the operator distributes to clients; ca.key never leaves the
host, 0600) and signs `*.<domain>` + `<domain>` with it; the leaf is re-signed at start when the
domain changed or fewer than RENEW_DAYS remain. EC P-256 keys: made in milliseconds.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from dsec.security.pki import key_pem as _key_pem, load_or_make_ca, server_leaf, write_file as _write
from dsec.types import InvalidArgument

CA_DAYS = 3650
LEAF_DAYS = 397          # what clients accept for a leaf at most (CA/Browser Forum)
RENEW_DAYS = 30
TLS_DIR = "tls"


def server_cert(home: Path, domain: str, cert: Path | None = None, key: Path | None = None) -> tuple[Path, Path]:
    """(certificate chain, key) files to serve `*.{domain}` with."""
    if cert or key:
        if not (cert and key):
            missing = "DSEC_TLS_KEY" if cert else "DSEC_TLS_CERT"
            raise InvalidArgument(f"{missing} is unset while the other of DSEC_TLS_CERT/DSEC_TLS_KEY is set",
                                  field=missing, fix="set both (PEM files), or neither for a certificate dsec signs")
        _check_names(cert, domain)
        return cert, key
    d = home / TLS_DIR
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_cert, ca_key = _ca(d)
    leaf, leaf_key = d / "server.pem", d / "server.key"
    if not _fresh(leaf, domain):
        _sign_leaf(ca_cert, ca_key, domain, leaf, leaf_key)
    return leaf, leaf_key


def ca_path(home: Path) -> Path:
    return home / TLS_DIR / "ca.pem"


def covers(cert: x509.Certificate, host: str) -> bool:
    """Whether the certificate's DNS names cover `host` (one wildcard label, as clients match)."""
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except x509.ExtensionNotFound:
        return False
    host = host.lower()
    for n in (n.lower() for n in names):
        if n == host or (n.startswith("*.") and host.partition(".")[2] == n[2:] and "." in host):
            return True
    return False


def _check_names(cert: Path, domain: str) -> None:
    try:
        leaf = x509.load_pem_x509_certificates(cert.read_bytes())[0]
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"DSEC_TLS_CERT={str(cert)!r} is not a readable PEM certificate: {e}",
                              field="DSEC_TLS_CERT", fix="point it at the wildcard certificate (chain) in PEM") from None
    if not covers(leaf, f"8000-sandbox.{domain}"):
        raise InvalidArgument(f"DSEC_TLS_CERT={str(cert)!r} does not name *.{domain}: clients would refuse it",
                              field="DSEC_TLS_CERT", fix=f"use a certificate whose subjectAltName has *.{domain}, "
                                                         "or unset DSEC_TLS_CERT/DSEC_TLS_KEY for one dsec signs")


def _ca(d: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    return load_or_make_ca(d / "ca.pem", d / "ca.key", "dsec sandbox ingress CA", CA_DAYS)


def _fresh(leaf: Path, domain: str) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(leaf.read_bytes())
    except (OSError, ValueError):
        return False
    left = cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc)
    return covers(cert, f"8000-sandbox.{domain}") and covers(cert, domain) and left > dt.timedelta(days=RENEW_DAYS)


def _sign_leaf(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, domain: str,
               cert_path: Path, key_path: Path) -> None:
    names: list[x509.GeneralName] = [x509.DNSName(f"*.{domain}"), x509.DNSName(domain)]
    try:   # a domain that is an address (tests, a bare IP set-up) also gets an IP entry
        names.append(x509.IPAddress(ipaddress.ip_address(domain)))
    except ValueError:
        pass
    key, cert = server_leaf(ca_cert, ca_key, f"*.{domain}", names, LEAF_DAYS)
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
