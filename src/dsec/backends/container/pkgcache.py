"""The node's package cache, served to sandboxes on <gateway>:DSEC_PKGCACHE_PORT (issue 25.4).

Sandboxes use it by name: PIP_INDEX_URL and npm_config_registry in their environment point here
(driver.prepare). Per request the sandbox is known by its source address (as the egress proxy
knows it) and may use an ecosystem only if its network policy reaches the configured upstream
(by name in its domains, or by its CIDR rules for the upstream's addresses): the cache is a
shortcut on the egress path, never a way around it. A miss is fetched by the node from the
address the policy allows (fetch.py, the same never-connect list as the proxy); a tunnelled
sandbox (egress_proxy) is refused: its traffic leaves only through its SOCKS server.

What a sandbox gets is decided by digests: index pages list only files whose digest upstream
gave, and a file is served only from the content-addressed store, which takes bytes only when
they hash to that digest (store.py). A sandbox can name a digest, never supply bytes, and can
fetch only URLs an upstream index answer named (a digest never seen is 404).

apt uses the cache as its HTTP proxy (an apt.conf.d file bound into Debian-based sandboxes,
pkgcache/apt.py): absolute `http://<mirror>/...` requests, allowed when the policy reaches that
mirror. Signed metadata passes through untouched (apt verifies it); by-hash files and .debs are
served from the store by the SHA256 in their URL or in a Packages index of the same mirror.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, unquote, urljoin, urlsplit

from dsec.backends.container.dns import SandboxView, Upstream
from dsec.backends.container.egress_proxy import _cidr_allows, _is_ipv4, forbidden
from dsec.backends.container.listener import SandboxListener
from dsec.pkgcache import apt, fetch
from dsec.pkgcache.index import (dumps, merge_npm_seeds, npm_name, parse_simple, pypi_name, render_simple,
                                 rewrite_npm, safe_filename, PypiFile)
from dsec.pkgcache.store import BlobStore, DigestMismatch, valid_digest
from dsec.security.netpolicy import compile_allows, egress_allows, tunnel_of
from dsec.types.domains import matches

log = logging.getLogger("dsec.backends.container.pkgcache")

HEAD_MAX = 8192
HEAD_TIMEOUT_S = 10.0
MAX_PER_SOURCE = 64
INDEX_MAX_BYTES = 64 << 20
FILE_MAX_BYTES = 4 << 30
APT_META_MAX_BYTES = 512 << 20    # Debian's Packages for one arch is ~50 MB uncompressed
NPM_ACCEPT = "application/vnd.npm.install-v1+json; q=1.0, application/json; q=0.8, */*"


def sandbox_env(gateway: str, port: int) -> dict[str, str]:
    """What every container sandbox gets (its own env wins): pip and npm ask the node's cache."""
    base = f"http://{gateway}:{port}"
    return {"PIP_INDEX_URL": f"{base}/pypi/simple/", "PIP_TRUSTED_HOST": f"{gateway}:{port}",
            "npm_config_registry": f"{base}/npm/"}


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


REASONS = {200: "OK", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request",
           502: "Bad Gateway"}


class PackageCache(SandboxListener):
    max_per_source = MAX_PER_SOURCE
    stream_limit = HEAD_MAX
    what = "package cache"

    def __init__(self, lookup: Callable[[str], SandboxView | None], upstream: Upstream, address: str, port: int,
                 subnet: ipaddress.IPv4Network, store: BlobStore, *, pypi_url: str, npm_url: str,
                 index_ttl_s: float, ca_file: str = "") -> None:
        super().__init__(address, port)
        self.lookup, self.upstream, self.store = lookup, upstream, store
        self.subnet = subnet
        self.pypi_url = pypi_url.rstrip("/") + "/"
        self.npm_url = npm_url.rstrip("/") + "/"
        self.index_ttl_s, self.ca_file = index_ttl_s, ca_file
        self.base = f"http://{address}:{port}"
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._apt_learned: set[tuple[str, str]] = set()   # (mirror, sha256) of Packages already read

    # -- HTTP ----------------------------------------------------------------------------------
    async def _handle(self, source: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request per connection (answers say Connection: close)."""
        async with asyncio.timeout(HEAD_TIMEOUT_S):
            head = await reader.readuntil(b"\r\n\r\n")
        method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        try:
            if target.startswith("http://"):   # apt, with the cache as its proxy
                await self._apt(source, method, target, writer)
            else:
                await self._route(source, method, urlsplit(target).path, writer)
        except HttpError as e:
            await self._send(writer, e.status, "text/plain; charset=utf-8",
                             f"dsec package cache: {e}\n".encode(), method == "HEAD")

    async def _send(self, writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes | Path,
                    head_only: bool = False) -> None:
        size = body.stat().st_size if isinstance(body, Path) else len(body)
        writer.write(f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                     f"Content-Length: {size}\r\nConnection: close\r\n\r\n".encode())
        if not head_only:
            if isinstance(body, Path):
                with open(body, "rb") as f:
                    await asyncio.get_running_loop().sendfile(writer.transport, f)
            else:
                writer.write(body)
        await writer.drain()

    def _view(self, source: str, method: str) -> SandboxView:
        if method not in ("GET", "HEAD"):
            raise HttpError(405, "the package cache is read-only (GET and HEAD only)")
        view = self.lookup(source)
        if view is None or not egress_allows(view.allows) or tunnel_of(view.allows) is not None:
            raise HttpError(403, "this sandbox has no egress (or sends it through its egress_proxy): "
                                 "the cache serves what its network policy could fetch itself")
        return view

    async def _route(self, source: str, method: str, path: str, writer: asyncio.StreamWriter) -> None:
        view = self._view(source, method)
        head_only = method == "HEAD"
        parts = path.split("/")
        if path.startswith("/pypi/"):
            await self._may_use(view, self.pypi_url, "pypi")
            if path == "/pypi/simple/" or path == "/pypi/simple":
                return await self._send(writer, 200, "text/html", b"<!DOCTYPE html><html><body></body></html>\n",
                                        head_only)
            if len(parts) in (4, 5) and parts[2] == "simple" and (len(parts) == 4 or parts[4] == ""):
                project = pypi_name(unquote(parts[3]))
                if project is None:
                    raise HttpError(404, f"not a project name: {parts[3][:100]!r}")
                body = await self._pypi_index(view, project)
                return await self._send(writer, 200, "text/html; charset=utf-8", body, head_only)
            if len(parts) == 6 and parts[2] == "files":
                f = await self._file(view, parts[3], parts[4], unquote(parts[5]))
                return await self._send(writer, 200, "application/octet-stream", f, head_only)
        elif path.startswith("/npm/"):
            await self._may_use(view, self.npm_url, "npm")
            if len(parts) == 6 and parts[2] == "-":
                f = await self._file(view, parts[3], parts[4], unquote(parts[5]))
                return await self._send(writer, 200, "application/octet-stream", f, head_only)
            name = npm_name("/".join(parts[2:]))
            if name is not None:
                body = await self._npm_meta(view, name)
                return await self._send(writer, 200, "application/json", body, head_only)
        raise HttpError(404, f"no such cache path: {path[:200]!r} (pip: /pypi/simple/<project>/, npm: /npm/<name>)")

    # -- policy --------------------------------------------------------------------------------
    def _connect_to(self, view: SandboxView):
        """The addresses a fetch for this sandbox may dial: by name if its domains cover the host,
        else those its CIDR rules allow; never the node, loopback, other sandboxes (forbidden)."""
        async def connect_to(host: str, port: int) -> list[str]:
            addrs = [host] if _is_ipv4(host) else await self.upstream.resolve4(host)
            addrs = [a for a in addrs if not forbidden(a, self.subnet)]
            if matches(host, view.domains):
                return addrs
            cidr = compile_allows(view.allows)
            return [a for a in addrs if _cidr_allows(cidr, a, port)]
        return connect_to

    async def _may_use(self, view: SandboxView, url: str, eco: str) -> None:
        u = urlsplit(url)
        host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
        if matches(host, view.domains):
            return
        cidr = compile_allows(view.allows)
        try:
            addrs = [host] if _is_ipv4(host) else await self.upstream.resolve4(host)
        except Exception:   # an offline node: only a policy open to any address covers the host
            addrs = ["0.0.0.0"]
        if any(_cidr_allows(cidr, a, port) for a in addrs or ["0.0.0.0"]):
            return
        raise HttpError(403, f"this sandbox's network policy does not reach {host} ({eco}'s upstream): "
                             f"add {host!r} to its network domains (or an operator's rule set that has it)")

    # -- pip -----------------------------------------------------------------------------------
    async def _index_page(self, view: SandboxView, key: str, url: str, accept: str) -> tuple[bytes, str] | None:
        """Upstream's answer for an index page (kept; reused within DSEC_PKGCACHE_INDEX_TTL_S and
        whenever upstream fails), with the URL it came from; None if neither."""
        stored = self.store.page(key)
        if stored is not None and time.time() - stored[1] < self.index_ttl_s:
            final, _, body = stored[0].partition(b"\n")
            return body, final.decode()
        try:
            body, final = await fetch.get(url, self._connect_to(view), accept=accept, max_bytes=INDEX_MAX_BYTES,
                                          ca_file=self.ca_file)
        except (fetch.FetchError, OSError, asyncio.TimeoutError) as e:
            log.info("package index upstream failed", extra={"url": fetch.redact(url), "error": str(e)})
            if stored is None:
                return None
            final, _, body = stored[0].partition(b"\n")
            return body, final.decode()
        self.store.save_page(key, final.encode() + b"\n" + body)
        return body, final

    async def _pypi_index(self, view: SandboxView, project: str) -> bytes:
        got = await self._index_page(view, f"pypi:{project}", urljoin(self.pypi_url, project + "/"), "text/html")
        files = parse_simple(got[0], got[1]) if got else []
        self.store.learn([("sha256", f.sha256, f.url, f.filename) for f in files])
        names = {f.filename for f in files}
        files += [PypiFile(s.filename, s.digest, "") for s in self.store.seeded("pypi", project)
                  if s.filename not in names]
        if got is None and not files:
            raise HttpError(502, f"{fetch.redact(self.pypi_url)} did not answer for {project!r} and the "
                                 "cache holds nothing for it (seed it: dsec cache seed DIR)")
        if not files:
            raise HttpError(404, f"no files with a sha256 for {project!r}")
        return render_simple(project, files, self.base)

    # -- npm -----------------------------------------------------------------------------------
    async def _npm_meta(self, view: SandboxView, name: str) -> bytes:
        url = self.npm_url + quote(name, safe="@")
        got = await self._index_page(view, f"npm:{name}", url, NPM_ACCEPT)
        doc: dict = {"name": name, "versions": {}, "dist-tags": {}}
        if got is not None:
            try:
                doc, learned = rewrite_npm(json.loads(got[0]), self.base, got[1])
            except (ValueError, AttributeError, TypeError):
                raise HttpError(502, f"{name}: upstream's metadata is not JSON") from None
            self.store.learn(learned)
        seeds = []
        for s in self.store.seeded("npm", name):
            meta = json.loads(s.meta)
            meta["dist"] = {**meta["dist"], "tarball": f"{self.base}/npm/-/sha512/{s.digest}/{s.filename}"}
            seeds.append(meta)
        if got is None and not seeds:
            raise HttpError(502, f"{fetch.redact(self.npm_url)} did not answer for {name!r} and the cache "
                                 "holds nothing for it (seed it: dsec cache seed DIR)")
        if not doc["versions"] and not seeds:
            raise HttpError(404, f"no versions with a sha512 integrity for {name!r}")
        return dumps(merge_npm_seeds(doc, seeds))

    # -- files ---------------------------------------------------------------------------------
    async def _file(self, view: SandboxView, algo: str, digest: str, filename: str,
                    source: tuple[str, str] | None = None) -> Path:
        if not valid_digest(algo, digest) or not safe_filename(filename):
            raise HttpError(404, "a file is named by <algo>/<hex digest>/<filename>")
        held = self.store.get(algo, digest)
        if held is not None:
            return held
        key = (algo, digest)
        waiting = self._inflight.get(key)
        if waiting is not None:   # one download per file per node, however many sandboxes ask
            await asyncio.shield(waiting)
            held = self.store.get(algo, digest)
            if held is not None:
                return held
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            return await self._download(view, algo, digest, source)
        finally:
            self._inflight.pop(key, None)
            fut.set_result(None)

    async def _download(self, view: SandboxView, algo: str, digest: str,
                        source: tuple[str, str] | None = None) -> Path:
        src = source or self.store.source_of(algo, digest)
        if src is None:
            raise HttpError(404, f"{algo} {digest} is in no index answer the cache has seen: ask for the "
                                 "project's index first (pip and npm do)")
        tmp = self.store.tmp_file()
        try:
            await fetch.get(src[0], self._connect_to(view), sink=tmp, max_bytes=FILE_MAX_BYTES, ca_file=self.ca_file)
            path = await asyncio.to_thread(self.store.put_file, algo, digest, tmp)
        except DigestMismatch as e:
            log.warning("package file refused: its bytes do not match the index",
                        extra={"url": fetch.redact(src[0]), "error": str(e), "sandbox": view.sandbox_id})
            raise HttpError(502, f"{src[1]}: upstream's bytes do not match the {algo} its index gave; refused") from None
        except (fetch.FetchError, OSError, asyncio.TimeoutError) as e:
            raise HttpError(502, f"{src[1]}: {e}") from None
        finally:
            tmp.unlink(missing_ok=True)
        log.info("package file cached", extra={"file": src[1], "algo": algo, "sandbox": view.sandbox_id})
        return path

    # -- apt -----------------------------------------------------------------------------------
    async def _apt(self, source: str, method: str, url: str, writer: asyncio.StreamWriter) -> None:
        view = self._view(source, method)
        what = apt.kind(url)
        if what is None:
            raise HttpError(404, "the package cache serves apt only: files under an http:// mirror's dists/ and "
                                 "its pool/ .debs; for anything else (apt-get source, changelogs) go direct: "
                                 "apt-get -o Acquire::http::Proxy=DIRECT ...")
        await self._may_use(view, url, "apt")
        asked, url = url, apt.key(url)   # fetched as asked, named in the store unquoted (as Filenames are)
        name = urlsplit(url).path.rsplit("/", 1)[-1]
        if what == "meta":
            f = await self._apt_meta(view, url, asked)
        elif what == "by-hash":
            digest = apt.by_hash_digest(url) or ""
            f = await self._file(view, "sha256", digest, name, (asked, name))
            base = apt.mirror_base(url)
            # only a Packages this mirror's own Release named speaks for its pool (apt.release_packages)
            if apt.is_packages(url) and self.store.apt_lookup(apt.index_key(base, digest)) is not None:
                await self._apt_learn(url, digest, f)
        else:
            named = self.store.apt_lookup(url)
            if named is None or named[1] != "deb":
                raise HttpError(404, f"{name}: no Packages index of this mirror that the cache fetched names it "
                                     "(run apt-get update first, with this cache as the proxy)")
            f = await self._file(view, "sha256", named[0], name, (asked, name))
        await self._send(writer, 200, "application/octet-stream", f, method == "HEAD")

    async def _apt_meta(self, view: SandboxView, url: str, asked: str) -> Path:
        """A mirror's metadata file as upstream gives it (apt checks the signature and hashes),
        kept by content; asked again after DSEC_PKGCACHE_INDEX_TTL_S, the kept one served while
        upstream fails (apt refuses it once its Release's Valid-Until has passed)."""
        named = self.store.apt_lookup(url)
        held = self.store.get("sha256", named[0]) if named is not None else None
        if held is not None and named is not None and time.time() - named[2] < self.index_ttl_s:
            return held
        tmp = self.store.tmp_file()
        try:
            await fetch.get(asked, self._connect_to(view), sink=tmp, max_bytes=APT_META_MAX_BYTES, ca_file=self.ca_file)
            digest = await asyncio.to_thread(_sha256_of, tmp)
            path = await asyncio.to_thread(self.store.put_file, "sha256", digest, tmp)
        except Exception as e:   # FetchError, OSError, timeouts, a name the node cannot resolve
            if isinstance(e, fetch.FetchError) and e.status == 404:
                raise HttpError(404, f"{fetch.redact(url)}: upstream has no such file") from None
            log.info("apt upstream failed", extra={"url": fetch.redact(url), "error": repr(e)})
            if held is not None:
                return held
            raise HttpError(502, f"{fetch.redact(url)}: upstream did not answer ({e}) and the cache holds "
                                 "no copy (seed one: dsec cache seed DIR --apt-mirror URL)") from None
        finally:
            tmp.unlink(missing_ok=True)
        named_now = [(url, digest, "meta")]
        if apt.is_release(url):
            base = apt.mirror_base(url)
            named_now += [(apt.index_key(base, d), d, "index") for d in await asyncio.to_thread(apt.release_packages, path)]
        self.store.apt_name(named_now)
        if apt.is_packages(url):   # fetched from this very URL of the mirror
            await self._apt_learn(url, digest, path)
        return path

    async def _apt_learn(self, url: str, digest: str, path: Path) -> None:
        """The .debs a Packages index names, by SHA256, for URLs under its own mirror only."""
        base = apt.mirror_base(url)
        if (base, digest) in self._apt_learned:
            return
        entries = await asyncio.to_thread(lambda: [(u, d, "deb") for u, d in apt.packages_entries(path, base)])
        await asyncio.to_thread(self.store.apt_name, entries)
        self._apt_learned.add((base, digest))


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
