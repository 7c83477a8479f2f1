"""Test upstreams for the package cache (issue 25.4), on this machine only.

`make_wheel` / `make_npm_tgz`: tiny real packages. `PackageUpstream`: a PyPI-like simple index
(PEP 503 pages with #sha256 fragments) and an npm-like registry (metadata JSON with
dist.integrity) served over HTTP from the egress peer's namespace (tests/egress_peer.py), with a
request log, optional basic auth, and files whose bytes can be swapped after the index names them.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

# run in a sandbox: argv[1] is a JSON list of [name, method, url]; prints {name: [status, body]}
FETCH = r'''
import json, sys, urllib.request, urllib.error
out = {}
for name, method, url in json.loads(sys.argv[1]):
    try:
        r = urllib.request.urlopen(urllib.request.Request(url, method=method, data=b"x" if method in ("PUT", "POST") else None), timeout=30)
        out[name] = [r.status, r.read().decode("utf-8", "replace")[:2000]]
    except urllib.error.HTTPError as e:
        out[name] = [e.code, e.read().decode("utf-8", "replace")[:500]]
    except OSError as e:
        out[name] = [0, type(e).__name__ + ":" + str(getattr(e, "reason", e))[:200]]
print(json.dumps(out))
'''


UPSTREAM_SERVER = r"""
import base64, os, sys
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
root, bind, port, log, auth = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
class H(SimpleHTTPRequestHandler):
    def __init__(self, *a, **k):
        super().__init__(*a, directory=root, **k)
    def do_GET(self):
        with open(log, "a") as f:
            f.write("%s %s\n" % (self.path, self.headers.get("Authorization") or "-"))
        if auth != "-" and self.headers.get("Authorization") != "Basic " + base64.b64encode(auth.encode()).decode():
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()
    def copyfile(self, src, dst):
        # an upstream at internet speed (benchmark): bytes/s from <log>.rate when it exists
        try:
            rate = int(open(log + ".rate").read())
        except (OSError, ValueError):
            rate = 0
        if not rate:
            return super().copyfile(src, dst)
        import time
        while chunk := src.read(65536):
            dst.write(chunk)
            time.sleep(len(chunk) / rate)
    def log_message(self, *a):
        pass
ThreadingHTTPServer.daemon_threads = True
srv = ThreadingHTTPServer((bind, port), H)
print("ready", flush=True)
srv.serve_forever()
"""


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, name: str, version: str, value: str, pad: int = 0) -> Path:
    """A pure-Python wheel: `import <name>; <name>.VALUE == value` (pad: bytes of random filler)."""
    files = {f"{name}/__init__.py": f"VALUE = {value!r}\n".encode(),
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: dsec-test\nRoot-Is-Purelib: true\n"
                                                  b"Tag: py3-none-any\n"}
    if pad:
        files[f"{name}/filler.bin"] = os.urandom(pad)
    record = "".join(f"{k},{_record_hash(v)},{len(v)}\n" for k, v in files.items())
    record += f"{name}-{version}.dist-info/RECORD,,\n"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{name}-{version}.dist-info/RECORD", record)
    return path


def make_npm_tgz(directory: Path, name: str, version: str, value: str) -> Path:
    path = directory / f"{name}-{version}.tgz"
    with tarfile.open(path, "w:gz") as t:
        for member, data in (("package/package.json", json.dumps({"name": name, "version": version,
                                                                  "main": "index.js"}).encode()),
                             ("package/index.js", f"module.exports = {json.dumps(value)};\n".encode())):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            info.mode = 0o644
            t.addfile(info, io.BytesIO(data))
    return path


class PackageUpstream:
    """Serves <root>/simple/<project>/index.html, <root>/files/*, <root>/npm/<name>, <root>/tarballs/*."""

    def __init__(self, ns: str, ip: str, root: Path, port: int = 8080, auth: str = "-") -> None:
        self.ns, self.ip, self.root, self.port, self.auth = ns, ip, root, port, auth
        self.log = root.parent / f"{root.name}-requests.log"
        for d in ("simple", "files", "npm", "tarballs"):
            (root / d).mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def add_wheel(self, project: str, wheel: Path, served: bytes | None = None) -> str:
        """List the wheel in its project's page with the sha256 of its bytes; `served`: other
        bytes under that name (a poisoned upstream). Returns the sha256."""
        data = wheel.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (self.root / "files" / wheel.name).write_bytes(served if served is not None else data)
        page = self.root / "simple" / project
        page.mkdir(exist_ok=True)
        (page / "index.html").write_text(f'<html><body><a href="../../files/{wheel.name}#sha256={digest}">'
                                         f'{wheel.name}</a></body></html>\n')
        return digest

    def add_npm(self, name: str, version: str, tgz: Path) -> None:
        data = tgz.read_bytes()
        integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
        (self.root / "tarballs" / tgz.name).write_bytes(data)
        doc = {"name": name, "dist-tags": {"latest": version},
               "versions": {version: {"name": name, "version": version,
                                      "dist": {"tarball": f"http://pypi.test:{self.port}/tarballs/{tgz.name}",
                                               "integrity": integrity}}}}
        (self.root / "npm" / name).write_text(json.dumps(doc))

    def set_rate(self, bytes_per_s: int) -> None:
        """Throttle every answer to this rate (0: as fast as it goes)."""
        Path(str(self.log) + ".rate").write_text(str(bytes_per_s))

    def requests(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def start(self) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, sys.executable, "-c", UPSTREAM_SERVER,
                                      str(self.root), self.ip, str(self.port), str(self.log), self.auth],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.ip, self.port), timeout=2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("package upstream did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
