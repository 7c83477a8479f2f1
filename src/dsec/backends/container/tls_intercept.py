"""Adding a secret on the way out (issue 30): the egress proxy's TLS termination for
destinations with a secret rule, and only those (egress_proxy.py decides by SNI).

Order matters for "fails rather than passing the secret": the upstream is connected and its
certificate verified (for the SNI name, against DSEC_NET_UPSTREAM_CA_FILE or the host's
store) before the sandbox's handshake is even answered; a destination that does not verify
gets nothing, and the sandbox sees its TLS connection closed. Then the sandbox's TLS is
terminated with a leaf of the node's egress CA for that name (the ClientHello the proxy
already read is fed in through a memory BIO), the request head is read, its Host must be the
SNI name (else 421: the secret is for that name only), the rule's headers replace any the
sandbox sent, `Connection: close` makes it one request per connection (so every request is
decided afresh, and a revoked rule is not added to the next one), and the rest is relayed.
The proxy speaks HTTP/1.1 to both sides (ALPN); upgrades (WebSocket) are not carried.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from dsec.types import EgressSecret

if TYPE_CHECKING:
    from dsec.backends.container.secret_rules import SecretRules
    from dsec.security.egress_ca import EgressCA

log = logging.getLogger("dsec.backends.container.tls_intercept")

HEAD_MAX = 65536
CONNECT_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 30.0
HOP_HEADERS = {b"connection", b"proxy-connection", b"keep-alive", b"upgrade"}


def upstream_context(ca_file: str) -> ssl.SSLContext:
    """How the proxy verifies a destination before giving it a secret."""
    ctx = ssl.create_default_context(cafile=ca_file or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class ServerTLS:
    """Server-side TLS over an asyncio stream pair whose first bytes were already read."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ctx: ssl.SSLContext) -> None:
        self.r, self.w = reader, writer
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._in, self._out, server_side=True)
        self._eof = False

    def feed(self, data: bytes) -> None:
        self._in.write(data)

    async def _flush(self) -> None:
        data = self._out.read()
        if data:
            self.w.write(data)
            await self.w.drain()

    async def _fill(self) -> None:
        chunk = await self.r.read(65536)
        if chunk:
            self._in.write(chunk)
        else:
            self._eof = True
            self._in.write_eof()

    async def handshake(self) -> None:
        while True:
            try:
                self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if self._eof:
                    raise ConnectionError("closed during the TLS handshake")
                await self._fill()
        await self._flush()

    async def read(self, n: int = 65536) -> bytes:
        while True:
            try:
                return self._obj.read(n)
            except ssl.SSLWantReadError:
                await self._flush()
                if self._eof:
                    return b""
                await self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def write(self, data: bytes) -> None:
        self._obj.write(data)
        await self._flush()

    async def close(self) -> None:
        try:
            self._obj.unwrap()
        except (ssl.SSLError, OSError):
            pass
        try:
            await self._flush()
        except OSError:
            pass


def rewrite_head(head: bytes, name: str, headers: dict[str, str] | None) -> bytes | str:
    """The request head with the rule's headers set and Connection: close; or an error status
    line when the request is not one the secret may be added to."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[1].startswith(b"/") or not parts[2].startswith(b"HTTP/1."):
        return "400 Bad Request"          # origin-form HTTP/1.x only (no absolute URI to elsewhere)
    drop = set(HOP_HEADERS) | {k.lower().encode() for k in (headers or {})}
    host, kept = None, []
    for line in lines[1:]:
        if not line:
            continue
        k, sep, v = line.partition(b":")
        if not sep or k != k.strip():
            return "400 Bad Request"
        key = k.lower()
        if key == b"host":
            if host is not None:
                return "400 Bad Request"
            host = v.strip().decode("ascii", "replace").lower()
        if key in drop:
            continue
        kept.append(line)
    if host is None or host.rsplit(":", 1)[0].rstrip(".") != name.lower().rstrip("."):
        return "421 Misdirected Request"
    added = [f"{k}: {v}".encode() for k, v in (headers or {}).items()]
    return b"\r\n".join([lines[0], *kept, *added, b"Connection: close"]) + b"\r\n\r\n"


async def intercept(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str,
                    port: int, addrs: list[str], server_ctx: Callable[[str], ssl.SSLContext],
                    upstream_ctx: ssl.SSLContext, rule_now: Callable[[], EgressSecret | None],
                    sandbox_id: str) -> None:
    up_r = up_w = None
    for a in addrs[:4]:
        try:
            up_r, up_w = await asyncio.wait_for(
                asyncio.open_connection(a, port, ssl=upstream_ctx, server_hostname=name,
                                        ssl_handshake_timeout=CONNECT_TIMEOUT_S), CONNECT_TIMEOUT_S)
            break
        except ssl.SSLError as e:   # the destination is not who it says: it gets nothing
            log.warning("egress secret not added: destination certificate refused",
                        extra={"sandbox": sandbox_id, "host": name, "address": a, "error": str(e)[:200]})
            return
        except (OSError, asyncio.TimeoutError):
            continue
    if up_r is None or up_w is None:
        return
    tls = ServerTLS(reader, writer, server_ctx(name))
    try:
        tls.feed(head)
        async with asyncio.timeout(IO_TIMEOUT_S):
            await tls.handshake()
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = await tls.read()
                if not chunk or len(buf) > HEAD_MAX:
                    return
                buf += chunk
        end = buf.index(b"\r\n\r\n") + 4
        rule = rule_now()                  # decided per request: a revoked rule is not added
        out = rewrite_head(buf[:end], name, rule.headers if rule else None)
        if isinstance(out, str):
            body = f"dsec: the egress proxy did not send this request to {name}: {out}\n".encode()
            await tls.write(f"HTTP/1.1 {out}\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            return
        up_w.write(out + buf[end:])
        await up_w.drain()

        async def up() -> None:            # sandbox -> destination (the body, if any)
            try:
                while data := await tls.read():
                    up_w.write(data)
                    await up_w.drain()
            except OSError:
                pass

        async def down() -> None:          # destination -> sandbox
            while data := await up_r.read(65536):
                await tls.write(data)
            await tls.close()

        sender = asyncio.ensure_future(up())
        try:
            await down()
        finally:
            sender.cancel()
    finally:
        up_w.close()


class Interceptor:
    """What the egress proxy asks about secrets: the rules of this node's sandboxes, the node's
    CA (made on first use) and the upstream trust."""

    def __init__(self, rules: "SecretRules", ca: Callable[[], "EgressCA"], upstream_ca_file: str = "") -> None:
        self.rules, self._get_ca, self.upstream_ca_file = rules, ca, upstream_ca_file
        self._upstream: ssl.SSLContext | None = None

    def ports(self, sandbox_id: str) -> set[int]:
        return self.rules.ports(sandbox_id)

    async def run(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str,
                  port: int, addrs: list[str], sandbox_id: str) -> None:
        if self._upstream is None:
            self._upstream = upstream_context(self.upstream_ca_file)
        ca = self._get_ca()
        await intercept(head, reader, writer, name, port, addrs, ca.server_context, self._upstream,
                        lambda: self.rules.match(sandbox_id, name, port), sandbox_id)
