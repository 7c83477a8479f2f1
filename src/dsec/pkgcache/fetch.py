"""One upstream GET over HTTP/1.1 (TLS for https), addresses from the caller's resolver.

The caller decides every host before it is dialled (`connect_to`: the node's resolver, the
proxy's never-connect list, and the asking sandbox's policy), redirects included, so the cache
reaches nothing the sandbox could not. Credentials in a URL's userinfo (a private index) go as
basic auth to that URL's host only, never to a redirect's.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
MAX_REDIRECTS = 4
MAX_HEAD = 65536

# host, port -> addresses to try (empty: refused)
ConnectTo = Callable[[str, int], Awaitable[list[str]]]


class FetchError(Exception):
    """Upstream could not be asked or did not answer 200 (the message says which; `status`: its
    HTTP status when it answered one)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def _ssl_context(ca_file: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca_file or None)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def get(url: str, connect_to: ConnectTo, *, accept: str = "*/*", sink: Path | None = None,
              max_bytes: int = 1 << 30, ca_file: str = "") -> tuple[bytes, str]:
    """The body (or written to `sink`, then b"") and the final URL. FetchError otherwise."""
    for _ in range(MAX_REDIRECTS + 1):
        status, headers, reader, writer = await _request(url, connect_to, accept, ca_file)
        try:
            if status in (301, 302, 303, 307, 308) and headers.get("location"):
                url = urljoin(redact(url), headers["location"])
                continue
            if status != 200:
                raise FetchError(f"{redact(url)} answered {status}", status)
            body = await asyncio.wait_for(_body(reader, headers, max_bytes, sink), READ_TIMEOUT_S * 10)
            return body, url
        finally:
            writer.close()
    raise FetchError(f"{redact(url)}: more than {MAX_REDIRECTS} redirects")


def redact(url: str) -> str:
    u = urlsplit(url)
    if "@" not in u.netloc:
        return url
    return u._replace(netloc=u.netloc.rsplit("@", 1)[1]).geturl()


async def _request(url: str, connect_to: ConnectTo, accept: str, ca_file: str):
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise FetchError(f"not an http(s) URL: {redact(url)}")
    port = u.port or (443 if u.scheme == "https" else 80)
    addrs = await connect_to(u.hostname, port)
    if not addrs:
        raise FetchError(f"{u.hostname}:{port} is not reachable for this sandbox's policy (or does not resolve)")
    tls = _ssl_context(ca_file) if u.scheme == "https" else None
    last: Exception | None = None
    for a in addrs[:4]:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(a, port, ssl=tls, server_hostname=u.hostname if tls else None,
                                        limit=MAX_HEAD), CONNECT_TIMEOUT_S)
            break
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            last = e
    else:
        raise FetchError(f"cannot connect to {u.hostname}:{port}: {last}")
    host = u.hostname if u.port is None else f"{u.hostname}:{u.port}"
    lines = [f"GET {u.path or '/'}{'?' + u.query if u.query else ''} HTTP/1.1", f"Host: {host}",
             f"Accept: {accept}", "User-Agent: dsec-pkgcache", "Accept-Encoding: identity", "Connection: close"]
    if u.username is not None:
        cred = f"{unquote(u.username)}:{unquote(u.password or '')}".encode()
        lines.append("Authorization: Basic " + base64.b64encode(cred).decode())
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, asyncio.TimeoutError) as e:
        writer.close()
        raise FetchError(f"{u.hostname}:{port} gave no HTTP answer: {e!r}") from None
    first, *rest = head.decode("latin-1").split("\r\n")
    try:
        status = int(first.split(" ", 2)[1])
    except (IndexError, ValueError):
        writer.close()
        raise FetchError(f"{u.hostname}:{port} gave no HTTP answer") from None
    headers = {}
    for line in rest:
        k, sep, v = line.partition(":")
        if sep:
            headers[k.strip().lower()] = v.strip()
    return status, headers, reader, writer


async def _body(reader: asyncio.StreamReader, headers: dict[str, str], max_bytes: int, sink: Path | None) -> bytes:
    out = open(sink, "wb") if sink is not None else None
    buf = bytearray()
    n = 0

    def put(data: bytes) -> None:
        nonlocal n
        n += len(data)
        if n > max_bytes:
            raise FetchError(f"answer larger than {max_bytes} bytes")
        if out is not None:
            out.write(data)
        else:
            buf.extend(data)
    try:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                if size == 0:
                    break
                put(await reader.readexactly(size))
                await reader.readexactly(2)
        elif "content-length" in headers:
            left = int(headers["content-length"])
            if left > max_bytes:
                raise FetchError(f"answer larger than {max_bytes} bytes")
            while left:
                chunk = await reader.read(min(left, 1 << 20))
                if not chunk:
                    raise FetchError("upstream closed before the end of the answer")
                put(chunk)
                left -= len(chunk)
        else:
            while chunk := await reader.read(1 << 20):
                put(chunk)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError) as e:
        raise FetchError(f"upstream answer cut short: {e!r}") from None
    finally:
        if out is not None:
            out.close()
    return bytes(buf)
