"""apt through the node's package cache (issue 25.4): which URLs are what, and what a Packages
index names.

Sandboxes' apt uses the cache as its HTTP proxy (`apt_conf`), so every request is an absolute
`http://<mirror>/<path>` URL. The cache passes the repository's signed metadata through
untouched (apt verifies InRelease with the keyring the image or the sandbox trusts, Packages by
the hashes InRelease gives, each .deb by its Packages' SHA256) and keeps it by content;
files apt names by their digest are served only from the content-addressed store:
- `.../dists/.../by-hash/SHA256/<hex>`: the digest is in the URL;
- `<base>/pool/...deb`: the SHA256 that a Packages index fetched from `<base>dists/...` gave
  for that Filename (learned here); a .deb no such index named is refused.
Nothing else is served (source packages, https mirrors: those go direct under the policy).
"""

from __future__ import annotations

import gzip
import lzma
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

DEB_SUFFIXES = (".deb", ".udeb", ".ddeb")
_BY_HASH = re.compile(r"/by-hash/SHA256/([0-9a-f]{64})$")
_PACKAGES = re.compile(r"/binary-[a-z0-9-]+/(Packages(\.gz|\.xz)?|by-hash/SHA256/[0-9a-f]{64})$")
CONF_NAME = "90dsec-pkgcache"
CONF_DIR_IN_SANDBOX = "/etc/apt/apt.conf.d"


def apt_conf(gateway: str, port: int) -> str:
    """What a sandbox's apt reads (bound read-only at /etc/apt/apt.conf.d/90dsec-pkgcache):
    http:// mirrors through the cache; https:// ones direct (apt's https method falls back to
    the Acquire::http settings: without its own line it would send CONNECT to the cache)."""
    return ("// dsec: apt asks the node's package cache, which serves what this sandbox's network\n"
            "// policy reaches (verified by the repository's signed hashes). To go direct: a later\n"
            "// file with Acquire::http::Proxy \"DIRECT\";\n"
            f"Acquire::http::Proxy \"http://{gateway}:{port}/\";\n"
            "Acquire::https::Proxy \"DIRECT\";\n"
            # one request per connection (the cache closes after each answer): no pipelining
            "Acquire::http::Pipeline-Depth \"0\";\n")


def key(url: str) -> str:
    """The URL as the store names it: its path unquoted, as Packages' Filenames are written
    (apt may quote characters such as '+' when it asks)."""
    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}{unquote(u.path)}"


def kind(url: str) -> str | None:
    """'by-hash', 'meta' (a file under dists/), 'deb', or None (not served)."""
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname or u.query or u.fragment:
        return None
    path = unquote(u.path)
    if "/../" in path + "/" or "/./" in path + "/" or "//" in path:
        return None
    if "/dists/" in path:
        return "by-hash" if _BY_HASH.search(path) else "meta"
    if path.endswith(DEB_SUFFIXES) and "/pool/" in path:
        return "deb"
    return None


def by_hash_digest(url: str) -> str | None:
    m = _BY_HASH.search(urlsplit(url).path)
    return m.group(1) if m else None


def is_packages(url: str) -> bool:
    """A binary Packages index (plain, .gz, .xz, or by-hash under binary-<arch>/)."""
    return bool(_PACKAGES.search(urlsplit(url).path))


def is_release(url: str) -> bool:
    return urlsplit(url).path.endswith(("/InRelease", "/Release"))


def index_key(base: str, sha256: str) -> str:
    """The store's row saying: this mirror's Release named a Packages index with this SHA256."""
    return f"{base}#packages:{sha256}"


def release_packages(path: Path) -> list[str]:
    """The SHA256s of the binary Packages indexes a Release/InRelease lists. A by-hash Packages
    is read for .deb digests only when its mirror's own Release (fetched by the cache from that
    mirror) named it: bytes another mirror gave under the same digest cannot speak for this one."""
    out, in_sha = [], False
    try:
        with open(path, "rb") as f:
            for raw in f:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if not line.startswith(" "):
                    in_sha = line.strip() == "SHA256:"
                    continue
                parts = line.split()
                if in_sha and len(parts) == 3 and re.fullmatch(r"[0-9a-f]{64}", parts[0]) \
                        and re.search(r"(^|/)binary-[a-z0-9-]+/Packages(\.gz|\.xz)?$", parts[2]):
                    out.append(parts[0])
    except OSError:
        return []
    return out


def mirror_base(url: str) -> str:
    """`http://host/debian/dists/bookworm/...` -> `http://host/debian/`: Filenames are relative to it."""
    return url[: url.index("/dists/") + 1]


def _open(path: Path):
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.open(path, "rb")
    if magic.startswith(b"\xfd7zXZ"):
        return lzma.open(path, "rb")
    return open(path, "rb")


def _safe_filename(name: str) -> bool:
    parts = name.split("/")
    return (bool(name) and not name.startswith("/") and ":" not in name and "\\" not in name
            and all(p not in ("", ".", "..") for p in parts) and name.endswith(DEB_SUFFIXES))


def packages_entries(path: Path, base: str) -> Iterator[tuple[str, str]]:
    """(url, sha256) of each .deb a Packages index (maybe compressed) names, under `base` only:
    a Filename that leaves the mirror's directory (`..`, absolute, a scheme) is skipped, so an
    index can speak only for files beside it."""
    filename = sha = None
    try:
        with _open(path) as f:
            for raw in f:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if not line.strip():
                    if filename and sha and _safe_filename(filename):
                        yield base + filename, sha
                    filename = sha = None
                elif line.startswith("Filename:"):
                    filename = line.split(":", 1)[1].strip()
                elif line.startswith("SHA256:"):
                    v = line.split(":", 1)[1].strip().lower()
                    sha = v if re.fullmatch(r"[0-9a-f]{64}", v) else None
    except (OSError, EOFError, lzma.LZMAError, gzip.BadGzipFile):
        return
    if filename and sha and _safe_filename(filename):
        yield base + filename, sha
