"""Index answers in and out: PyPI's simple pages (PEP 503) and npm's package metadata.

Parsing keeps only files whose digest the answer gives (a PEP 503 `#sha256=` fragment, npm's
`dist.integrity` sha512): a file without one could not be checked, so it is not offered.
Rendering points every file at the cache (`<base>/pypi/files/sha256/<hex>/<name>`,
`<base>/npm/-/sha512/<hex>/<name>`): sandboxes never learn upstream URLs or their credentials.
"""

from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_NPM_NAME = re.compile(r"^(@[a-z0-9][a-z0-9._~-]{0,100}/)?[a-z0-9][a-z0-9._~-]{0,213}$")


def pypi_name(name: str) -> str | None:
    """PEP 503's normalized name, or None for anything that is not a project name."""
    if not _NAME.match(name):
        return None
    return re.sub(r"[-_.]+", "-", name).lower()


def npm_name(name: str) -> str | None:
    name = unquote(name)
    return name if _NPM_NAME.match(name) else None


def safe_filename(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and len(name) < 256


@dataclass(frozen=True)
class PypiFile:
    filename: str
    sha256: str
    url: str                      # upstream (may carry the index's credentials: never rendered)
    requires_python: str | None = None
    yanked: str | None = None


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.found.append(dict(attrs))


def parse_simple(body: bytes, page_url: str) -> list[PypiFile]:
    p = _Anchors()
    p.feed(body.decode("utf-8", "replace"))
    out = []
    for a in p.found:
        href = a.get("href")
        if not href:
            continue
        url, frag = urldefrag(urljoin(page_url, href))
        algo, _, digest = frag.partition("=")
        name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
        if algo != "sha256" or len(digest) != 64 or not safe_filename(name):
            continue
        out.append(PypiFile(name, digest.lower(), url, a.get("data-requires-python"), a.get("data-yanked")))
    return out


def render_simple(project: str, files: list[PypiFile], base: str) -> bytes:
    rows = []
    for f in files:
        attrs = ""
        if f.requires_python:
            attrs += f' data-requires-python="{html.escape(f.requires_python)}"'
        if f.yanked is not None:
            attrs += f' data-yanked="{html.escape(f.yanked)}"'
        href = f"{base}/pypi/files/sha256/{f.sha256}/{html.escape(f.filename)}#sha256={f.sha256}"
        rows.append(f'<a href="{href}"{attrs}>{html.escape(f.filename)}</a><br/>')
    return ("<!DOCTYPE html>\n<html><head><meta name=\"pypi:repository-version\" content=\"1.0\">"
            f"<title>Links for {html.escape(project)}</title></head><body>\n<h1>Links for {html.escape(project)}</h1>\n"
            + "\n".join(rows) + "\n</body></html>\n").encode()


def sha512_of_integrity(integrity: str | None) -> str | None:
    """npm's `dist.integrity` (SRI, maybe several) -> the sha512 as hex."""
    for part in (integrity or "").split():
        algo, _, b64 = part.partition("-")
        if algo == "sha512":
            try:
                raw = base64.b64decode(b64, validate=True)
            except ValueError:
                return None
            return raw.hex() if len(raw) == 64 else None
    return None


def integrity_of_sha512(hexdigest: str) -> str:
    return "sha512-" + base64.b64encode(bytes.fromhex(hexdigest)).decode()


def rewrite_npm(doc: dict, base: str, page_url: str) -> tuple[dict, list[tuple[str, str, str, str]]]:
    """npm metadata with every tarball at the cache, versions without a sha512 dropped; and the
    (algo, digest, upstream url, filename) the cache learns from it."""
    learned = []
    versions = {}
    for v, meta in (doc.get("versions") or {}).items():
        if not isinstance(meta, dict) or not isinstance(meta.get("dist"), dict):
            continue
        dist = meta["dist"]
        digest = sha512_of_integrity(dist.get("integrity"))
        url = urljoin(page_url, str(dist.get("tarball") or ""))
        name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
        if digest is None or not safe_filename(name):
            continue
        learned.append(("sha512", digest, url, name))
        versions[v] = {**meta, "dist": {**dist, "tarball": f"{base}/npm/-/sha512/{digest}/{name}"}}
    out = {**doc, "versions": versions}
    out["dist-tags"] = {t: v for t, v in (doc.get("dist-tags") or {}).items() if v in versions}
    return out, learned


def merge_npm_seeds(doc: dict, seeds: list[dict]) -> dict:
    """Seeded versions (their metadata, tarball at the cache) beside upstream's; upstream wins."""
    versions = dict(doc.get("versions") or {})
    for meta in seeds:
        versions.setdefault(meta["version"], meta)
    tags = dict(doc.get("dist-tags") or {})
    if versions and "latest" not in tags:
        tags["latest"] = max(versions, key=_semver_key)
    return {**doc, "versions": versions, "dist-tags": tags}


def _semver_key(v: str) -> tuple:
    core, _, pre = v.partition("-")
    nums = tuple(int(x) if x.isdigit() else 0 for x in core.split("."))
    return (nums, pre == "", pre)


def dumps(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()
