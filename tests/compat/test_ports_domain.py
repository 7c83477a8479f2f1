"""Ports on a domain (issue 25 item 5): with DSEC_DOMAIN set, the stock SDK's get_host(port)
names `{port}-{id}.{domain}`, served over HTTPS (a certificate from the CA dsec made in its
home) and HTTP, with the traffic token checked and never handed to the sandbox. curl with
--resolve stands in for the wildcard DNS record; --cacert for the CA the operator distributes."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from conftest import E2B_TEST_DOMAIN

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")
from e2b import Sandbox  # noqa: E402

ECHO = """
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


def curl(url: str, host: str, port: int, *extra: str, ca: str | None = None) -> subprocess.CompletedProcess:
    args = ["curl", "-sS", "--max-time", "30", "--resolve", f"{host}:{port}:127.0.0.1", "-w", "\n%{http_code}"]
    if ca:
        args += ["--cacert", ca]
    return subprocess.run([*args, *extra, url], capture_output=True, text=True, timeout=60)


def test_get_host_is_served_over_https_and_keeps_tokens_out(server, e2b_env):
    https_port = int(server.env["DSEC_HTTPS_PORT"])
    ca = str(server.paths.home / "tls" / "ca.pem")
    sbx = Sandbox.create("debian-python")
    try:
        sbx.files.write("/tmp/echo.py", ECHO)
        sbx.commands.run("python3 /tmp/echo.py", background=True)
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.{E2B_TEST_DOMAIN}"
        token = sbx.traffic_access_token
        secrets = ["-H", f"E2B-Traffic-Access-Token: {token}", "-H", f"X-Access-Token: {sbx._envd_access_token}",
                   "-H", f"Authorization: Bearer {server.key}", "-H", "X-Custom: kept"]
        deadline = time.monotonic() + 30
        while True:       # until the server in the sandbox listens
            r = curl(f"https://{host}:{https_port}/p?q=1", host, https_port, *secrets, ca=ca)
            if r.stdout.endswith("\n200") or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        body, _, code = r.stdout.rpartition("\n")
        assert code == "200", (r.stdout, r.stderr)
        seen = json.loads(body)
        assert seen["path"] == "/p?q=1" and seen["headers"]["x-custom"] == "kept", seen
        # the sandbox sees none of the caller's credentials
        for h in ("e2b-traffic-access-token", "x-access-token", "authorization", "x-api-key"):
            assert h not in seen["headers"], seen
        assert token not in body and server.key not in body
        # the same name over plain HTTP
        r = curl(f"http://{host}:{server.port}/p", host, server.port, "-H", f"E2B-Traffic-Access-Token: {token}")
        assert r.stdout.endswith("\n200"), r.stdout
        # checked as before: no token, a wrong one -> 401, over TLS too
        for extra in ([], ["-H", "E2B-Traffic-Access-Token: wrong"]):
            r = curl(f"https://{host}:{https_port}/", host, https_port, *extra, ca=ca)
            assert r.stdout.endswith("\n401"), r.stdout
        # a client that does not trust dsec's CA refuses the certificate
        r = curl(f"https://{host}:{https_port}/", host, https_port, "--cacert", "/etc/ssl/certs/ca-certificates.crt")
        assert r.returncode == 60, (r.returncode, r.stderr)
    finally:
        sbx.kill()


def test_the_certificate_names_the_wildcard_and_is_signed_by_the_homes_ca(server):
    from cryptography import x509

    from dsec.apiserver.tls import covers
    leaf = x509.load_pem_x509_certificate((server.paths.home / "tls" / "server.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((server.paths.home / "tls" / "ca.pem").read_bytes())
    assert covers(leaf, f"8000-local-0123456789ab.{E2B_TEST_DOMAIN}")
    assert not covers(leaf, f"a.b.{E2B_TEST_DOMAIN}") and not covers(leaf, "other.test")
    leaf.verify_directly_issued_by(ca)
    assert (server.paths.home / "tls" / "ca.key").stat().st_mode & 0o077 == 0
