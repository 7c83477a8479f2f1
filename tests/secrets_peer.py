"""Fixtures and probes for the egress secrets tests (issue 30): a peer whose secret.test and
other.test certificates come from a local "public" CA (the server's DSEC_NET_UPSTREAM_CA_FILE),
bad.test with a self-signed one; /headers answers SHA-256 digests of what it received, so a
sandbox never gets a value back. Nothing leaves the machine."""

from __future__ import annotations

import datetime
import hashlib
import json
import secrets
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from egress_peer import READ_ALL, egress_peer, side_server

SECRET = "sk-dsec-" + secrets.token_hex(16)
BASIC = "robot:" + secrets.token_hex(12)


def _cert(name: str, issuer_key, issuer_name, ca: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2)))
    if ca:
        b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
    return key, b.sign(issuer_key or key, hashes.SHA256())


def _write(dirpath: Path, name: str, key, cert) -> tuple[str, str]:
    c, k = dirpath / f"{name}.pem", dirpath / f"{name}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return str(c), str(k)


@pytest.fixture(scope="module")
def speer(tmp_path_factory):
    from conftest import requires_root
    requires_root()
    d = tmp_path_factory.mktemp("secrets-peer")
    ca_key, ca = _cert("local public CA", None, None, ca=True)
    _write(d, "ca", ca_key, ca)
    certs = {n: _write(d, n, *_cert(n, ca_key, ca.subject)) for n in ("secret.test", "other.test")}
    with egress_peer(d, certs) as p:
        p.set_zone({"secret.test": p.ip, "other.test": p.ip, "bad.test": p.ip})
        p.ca_file = str(d / "ca.pem")
        yield p


@pytest.fixture(scope="module")
def sserver(images, dsec_home, tmp_path_factory, speer):
    with side_server(dsec_home, tmp_path_factory, "secrets", speer, DSEC_NET_UPSTREAM_CA_FILE=speer.ca_file) as srv:
        yield srv


# Run in the sandbox: argv[1] JSON list of [name, url, {"sni":..., "host":..., "verify": bool}];
# prints {name: "ok:<status> <body>" | "err:<what>"} to argv[2], then sleeps (memory is dumped).
PROBE = READ_ALL + r'''
import json, socket, ssl, sys, time, urllib.request
from urllib.parse import urlsplit
def get(url, opts):
    try:
        if opts.get("raw"):           # one request by hand: chosen SNI and Host
            u = urlsplit(url)
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            s = ctx.wrap_socket(socket.create_connection((u.hostname, 443), timeout=10),
                                server_hostname=opts.get("sni") or None)
            s.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (u.path, opts["host"])).encode())
            data = read_all(s)
            head, _, body = data.partition(b"\r\n\r\n")
            return "ok:%s %s" % (head.split(b" ")[1].decode(), body.decode().strip())
        ctx = ssl.create_default_context()      # SSL_CERT_FILE: the bundle dsec bound
        if not opts.get("verify", True):
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(url, timeout=10, context=ctx) as r:
            return "ok:%d %s" % (r.status, r.read().decode().strip())
    except urllib.error.HTTPError as e:
        return "ok:%d %s" % (e.code, e.read().decode().strip()[:200])
    except Exception as e:
        return "err:" + type(e).__name__ + ":" + str(e)[:160]
out = {n: get(u, o) for n, u, o in json.loads(sys.argv[1])}
open(sys.argv[2] + ".tmp", "w").write(json.dumps(out))
import os
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
if len(sys.argv) > 3:
    time.sleep(float(sys.argv[3]))
'''


def digest(v: str) -> str:
    return hashlib.sha256(v.encode()).hexdigest()


async def probe(sb, checks: list, linger_s: float = 0) -> dict:
    await sb.files.write("/tmp/sprobe.py", PROBE)
    out = f"/tmp/sprobe-{secrets.token_hex(4)}.json"
    cmd = f"python3 /tmp/sprobe.py '{json.dumps(checks)}' {out}"
    if linger_s:
        await sb.run(f"setsid {cmd} {linger_s} >/dev/null 2>&1 < /dev/null &", timeout_s=30)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            r = await sb.run(f"cat {out} 2>/dev/null", timeout_s=30)
            if r.stdout.strip():
                return json.loads(r.stdout)
            time.sleep(0.3)
        raise AssertionError("probe gave no answer")
    r = await sb.run(f"{cmd} && cat {out}", timeout_s=120)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def headers_of(result: str) -> dict:
    assert result.startswith("ok:200 "), result
    return json.loads(result[len("ok:200 "):])


def sandbox_pids(sandbox_id: str) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if sandbox_id in (p / "cgroup").read_text():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def memory_holds(pid: int, needle: bytes) -> bool:
    """Whether any readable mapping of the process holds the bytes (read from the host)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb", buffering=0)
    except OSError:
        return False
    with mem:
        for line in maps:
            addr, perms = line.split()[:2]
            if "r" not in perms:
                continue
            lo, hi = (int(x, 16) for x in addr.split("-"))
            if hi - lo > 1 << 30:
                continue
            try:
                mem.seek(lo)
                if needle in mem.read(hi - lo):
                    return True
            except (OSError, OverflowError, ValueError):
                continue
    return False
