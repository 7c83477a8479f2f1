"""A tiny signed Debian repository for the package cache's apt tests (issue 25.4), on this box.

`make_deb`: a real .deb (dpkg-deb) installing /usr/share/<name>/value. `AptRepo`: a mirror
directory (dists/<suite>/main/binary-amd64/Packages{,.gz} also under by-hash/SHA256/, pool/)
whose InRelease is clearsigned with a throw-away gpg key (the sandbox trusts it by signed-by=).
It is served by tests/pkgcache_peer.py's PackageUpstream (the mirror under its root).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
from pathlib import Path


def make_deb(directory: Path, name: str, version: str, value: str) -> Path:
    root = directory / f"build-{name}-{version}-{os.urandom(3).hex()}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(f"Package: {name}\nVersion: {version}\nArchitecture: all\n"
                                             f"Maintainer: dsec tests <t@dsec.invalid>\nDescription: {name}\n")
    (root / "usr" / "share" / name).mkdir(parents=True)
    (root / "usr" / "share" / name / "value").write_text(value + "\n")
    out = directory / f"{name}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(out)], check=True,
                   capture_output=True)
    shutil.rmtree(root)
    return out


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class AptRepo:
    """A mirror at <root> (URL http://<host>/<prefix>/), suite `stable`, component `main`."""

    def __init__(self, root: Path, gnupg: Path) -> None:
        self.root, self.gnupg = root, gnupg
        gnupg.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._gpg("--quick-gen-key", "dsec apt test <apt@dsec.invalid>", "ed25519", "sign", "never")
        self.debs: list[tuple[str, bytes, bytes]] = []   # (Filename, listed bytes, served bytes)

    def _gpg(self, *args: str) -> bytes:
        return subprocess.run(["gpg", "--homedir", str(self.gnupg), "--batch", "--yes", "--pinentry-mode", "loopback",
                               "--passphrase", "", *args], check=True, capture_output=True).stdout

    def keyring(self) -> bytes:
        """The public key as a binary keyring (for [signed-by=...])."""
        return self._gpg("--export")

    def add(self, deb: Path, served: bytes | None = None) -> str:
        """List `deb` (its SHA256 in Packages); `served`: other bytes under its name (a tampered
        upstream). Returns its pool path."""
        name = deb.name.split("_", 1)[0]
        filename = f"pool/main/{name[0]}/{name}/{deb.name}"
        self.debs.append((filename, deb.read_bytes(), served if served is not None else deb.read_bytes()))
        return filename

    def publish(self) -> None:
        entries = []
        for filename, listed, served in self.debs:
            p = self.root / filename
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(served)
            name, version = Path(filename).name.split("_")[:2]
            entries.append(f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: dsec tests "
                           f"<t@dsec.invalid>\nFilename: {filename}\nSize: {len(listed)}\nSHA256: {_sha(listed)}\n"
                           f"Description: {name}\n")
        packages = "\n".join(entries).encode()
        dist = self.root / "dists" / "stable"
        binary = dist / "main" / "binary-amd64"
        (binary / "by-hash" / "SHA256").mkdir(parents=True, exist_ok=True)
        files = {"main/binary-amd64/Packages": packages, "main/binary-amd64/Packages.gz": gzip.compress(packages)}
        for rel, data in files.items():
            (dist / rel).write_bytes(data)
            (binary / "by-hash" / "SHA256" / _sha(data)).write_bytes(data)
        release = ("Origin: dsec\nLabel: dsec\nSuite: stable\nCodename: stable\n"
                   "Date: Sat, 05 Dec 2026 00:00:00 UTC\nArchitectures: amd64 all\nComponents: main\n"
                   "Acquire-By-Hash: yes\nSHA256:\n"
                   + "".join(f" {_sha(d)} {len(d)} {rel}\n" for rel, d in files.items()))
        (dist / "Release").write_text(release)
        (dist / "InRelease").write_bytes(self._gpg("--digest-algo", "SHA256", "--clearsign", "-o", "-",
                                                   str(dist / "Release")))

    def close(self) -> None:
        subprocess.run(["gpgconf", "--homedir", str(self.gnupg), "--kill", "gpg-agent"], capture_output=True)
