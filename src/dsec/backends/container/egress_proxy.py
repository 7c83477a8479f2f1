"""The node's egress proxy: TCP 80/443 of sandboxes with domain rules, decided by name.

nftables sends a domain-mode sandbox's TCP 80 and 443 (any address) here (network.py). Per
connection, the sandbox is known by its source address, the port it asked for by
SO_ORIGINAL_DST. Then:
- the original address is allowed by the sandbox's CIDR rules: spliced to it unchanged;
- else the name is read from the first bytes (TLS ClientHello SNI, or the HTTP Host header),
  checked against the sandbox's domain patterns, resolved by the node's upstream (never the
  address the sandbox chose: a raw IP or a lying DNS answer gains nothing) and connected to;
- anything else is closed (plain HTTP gets a 403 that names the fix).
Never connected to, whatever a name resolves to: this host's own addresses (a bind() test),
loopback, link-local, multicast, reserved and the sandbox subnet (other sandboxes).
Residual risk, documented in docs/decisions.md: domain fronting (an allowed SNI, another Host
inside TLS) and later requests of a kept-alive HTTP connection reach the allowed name's server.
Secrets (issue 30, tls_intercept.py): a sandbox with secret rules also sends its TCP 443 here
whatever its policy; on a port a rule names, the SNI is read first, and a name with a rule
(allowed by the sandbox's policy) is terminated and the secret added; anything else goes on as
above, the TLS untouched.
A sandbox with an egress proxy (NetworkPolicy.egress_proxy, E2B's egress_proxy) sends ALL its
TCP here (nft set tunnel4); what its policy allows (the CIDR rules by address and port, 80/443 by
name as above) is carried through that SOCKS5 server (socks5.py), by name when the decision was
by name; if the server is down or refuses, the sandbox's connection is closed, never direct.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct

from dsec.backends.container.dns import Lookup, Upstream
from dsec.backends.container.listener import SandboxListener
from dsec.backends.container.socks5 import SocksRefused, socks_connect, split_address
from dsec.backends.container.tls_intercept import Interceptor
from dsec.security.netpolicy import compile_allows, tunnel_of
from dsec.types.domains import matches

log = logging.getLogger("dsec.backends.container.egress_proxy")

SO_ORIGINAL_DST = 80
HEAD_MAX = 16384              # bytes read to find the name
HEAD_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
MAX_PER_SOURCE = 256          # open proxied connections per sandbox
PIPE_CHUNK = 65536


def sni_of(data: bytes) -> str | None | bool:
    """The server name of a TLS ClientHello: the name, None when the hello has none, False while
    more bytes are needed. Raises ValueError on anything that is not a ClientHello."""
    if len(data) < 5:
        return False
    if data[0] != 0x16:
        raise ValueError("not a TLS handshake")
    rec_len = struct.unpack(">H", data[3:5])[0]
    if len(data) < 5 + rec_len:
        return False
    b = data[5:5 + rec_len]
    if len(b) < 4 or b[0] != 0x01:
        raise ValueError("not a ClientHello")
    hs_len = int.from_bytes(b[1:4], "big")
    if hs_len > len(b) - 4:
        raise ValueError("ClientHello spans records")   # real clients send it in one record
    p = 4 + 2 + 32
    p += 1 + b[p]                                        # session id
    p += 2 + struct.unpack(">H", b[p:p + 2])[0]          # cipher suites
    p += 1 + b[p]                                        # compression methods
    if p + 2 > len(b):
        return None
    end = min(len(b), p + 2 + struct.unpack(">H", b[p:p + 2])[0])
    p += 2
    while p + 4 <= end:
        etype, elen = struct.unpack(">HH", b[p:p + 4])
        p += 4
        if etype == 0:                                   # server_name
            q = p + 2
            while q + 3 <= p + elen:
                ntype, nlen = b[q], struct.unpack(">H", b[q + 1:q + 3])[0]
                if ntype == 0:
                    return b[q + 3:q + 3 + nlen].decode("ascii", "strict")
                q += 3 + nlen
            return None
        p += elen
    return None


def host_of(data: bytes) -> str | None | bool:
    """The Host of an HTTP/1 request head: the name, None if it has none, False if incomplete."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False
    for line in data[:end].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"host":
            host = v.strip().decode("ascii", "strict")
            if host.startswith("["):
                return host   # an IPv6 literal never matches a pattern
            return host.rsplit(":", 1)[0] if ":" in host else host
    return None


def forbidden(ip: str, subnet: ipaddress.IPv4Network) -> bool:
    """Addresses the proxy never connects to: the host itself, other sandboxes, special ranges."""
    a = ipaddress.ip_address(ip)
    if a.version != 4 or a.is_loopback or a.is_link_local or a.is_multicast or a.is_unspecified \
            or a.is_reserved or a in subnet or a == ipaddress.IPv4Address("255.255.255.255"):
        return True
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((ip, 0))   # succeeds only for an address of this host (network namespace)
        return True
    except OSError:
        return False
    finally:
        s.close()


class EgressProxy(SandboxListener):
    max_per_source = MAX_PER_SOURCE
    what = "egress proxy"

    def __init__(self, lookup: Lookup, upstream: Upstream, address: str, port: int,
                 subnet: ipaddress.IPv4Network, interceptor: Interceptor | None = None) -> None:
        super().__init__(address, port)
        self.lookup, self.upstream, self.interceptor = lookup, upstream, interceptor
        self.subnet = subnet

    async def _handle(self, source: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        view = self.lookup(source)
        if view is None:
            return
        sock = writer.get_extra_info("socket")
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port = struct.unpack(">H", raw[2:4])[0]
        orig = socket.inet_ntoa(raw[4:8])
        tunnel = tunnel_of(view.allows)
        if tunnel is not None:
            await self._tunnel(view, tunnel, orig, port, reader, writer)
            return
        secrets = self.interceptor is not None and port in self.interceptor.ports(view.sandbox_id)
        if not view.domains and not (self.interceptor is not None and self.interceptor.rules.has(view.sandbox_id)):
            return   # in the proxy's set for neither names nor secrets (a stale DNAT): nothing
        cidr = compile_allows(view.allows)
        if not secrets and _cidr_allows(cidr, orig, port) and not forbidden(orig, self.subnet):
            await self._splice(b"", reader, writer, [orig], port)
            return
        head, name = b"", None
        async with asyncio.timeout(HEAD_TIMEOUT_S):
            while True:
                chunk = await reader.read(HEAD_MAX - len(head))
                if not chunk:
                    return
                head += chunk
                found = sni_of(head) if head[:1] == b"\x16" else host_of(head)
                if found is not False:
                    name = found
                    break
                if len(head) >= HEAD_MAX:
                    return
        if secrets and await self._secret(view, head, name, port, cidr, reader, writer):
            return
        if secrets and _cidr_allows(cidr, orig, port) and not forbidden(orig, self.subnet):
            await self._splice(head, reader, writer, [orig], port)   # no rule for it: untouched
            return
        if not name or not matches(name, view.domains):
            log.info("egress refused", extra={"sandbox": view.sandbox_id, "host": (name or "")[:253], "port": port})
            if head[:1] != b"\x16":
                body = (f"dsec: egress to {name or '(no Host)'!s:.253} is not allowed for this sandbox; "
                        "add the name to its network policy's domains\n").encode()
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
            return
        addrs = [a for a in await self.upstream.resolve4(name) if not forbidden(a, self.subnet)]
        if not addrs:
            log.info("egress name has no permitted address", extra={"sandbox": view.sandbox_id, "host": name})
            return
        await self._splice(head, reader, writer, addrs, port)

    async def _tunnel(self, view, tunnel: str, orig: str, port: int,
                      reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Every TCP connection of a tunnelled sandbox: decided as a direct one would be (the CIDR
        rules by address and port, else 80/443 by name), then carried through its SOCKS5 proxy;
        anything the proxy cannot carry is closed (fail-closed: there is no direct path)."""
        cidr = compile_allows(view.allows)
        if forbidden(orig, self.subnet):
            return
        head, target = b"", None
        if _cidr_allows(cidr, orig, port):
            target = orig
        elif view.domains and port in (80, 443):
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                while True:
                    chunk = await reader.read(HEAD_MAX - len(head))
                    if not chunk or len(head) + len(chunk) > HEAD_MAX:
                        return
                    head += chunk
                    found = sni_of(head) if head[:1] == b"\x16" else host_of(head)
                    if found is not False:
                        break
            if not found or not matches(found, view.domains):
                log.info("egress refused", extra={"sandbox": view.sandbox_id, "host": (found or "")[:253],
                                                   "port": port})
                return
            target = found   # by name: the SOCKS server resolves it, the sandbox's address is ignored
        if target is None:
            return
        host, sport = split_address(tunnel)
        addrs = [host] if _is_ipv4(host) else await self.upstream.resolve4(host)
        addrs = [a for a in addrs if not forbidden(a, self.subnet)]
        auth = self.interceptor.rules.tunnel_auth(view.sandbox_id) if self.interceptor is not None else None
        up_r = up_w = None
        for a in addrs[:4]:
            try:
                up_r, up_w = await asyncio.wait_for(asyncio.open_connection(a, sport), CONNECT_TIMEOUT_S)
                break
            except (OSError, asyncio.TimeoutError):
                continue
        if up_r is None or up_w is None:
            log.info("egress proxy unreachable", extra={"sandbox": view.sandbox_id, "proxy": tunnel})
            return
        try:
            await asyncio.wait_for(socks_connect(up_r, up_w, target, port, auth), CONNECT_TIMEOUT_S)
            if head:
                up_w.write(head)
            await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
        except SocksRefused as e:
            log.info("egress proxy refused", extra={"sandbox": view.sandbox_id, "proxy": tunnel, "error": str(e)})
        finally:
            up_w.close()

    async def _secret(self, view, head: bytes, name: str | None, port: int, cidr: dict,
                      reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """A TLS connection to a name with a secret rule: added there (True), if the sandbox's
        policy reaches the name (its domains, or its CIDR rules for the address the proxy
        resolves); else False and the connection goes on as any other."""
        assert self.interceptor is not None
        if not name or head[:1] != b"\x16" or self.interceptor.rules.match(view.sandbox_id, name, port) is None:
            return False
        addrs = [a for a in await self.upstream.resolve4(name) if not forbidden(a, self.subnet)]
        if not matches(name, view.domains):
            addrs = [a for a in addrs if _cidr_allows(cidr, a, port)]
        if not addrs:
            log.info("egress secret destination not reachable by the policy",
                     extra={"sandbox": view.sandbox_id, "host": name})
            return True
        await self.interceptor.run(head, reader, writer, name, port, addrs, view.sandbox_id)
        return True

    async def _splice(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      addrs: list[str], port: int) -> None:
        up_r = up_w = None
        for a in addrs[:4]:
            try:
                up_r, up_w = await asyncio.wait_for(asyncio.open_connection(a, port), CONNECT_TIMEOUT_S)
                break
            except (OSError, asyncio.TimeoutError):
                continue
        if up_w is None or up_r is None:
            return
        try:
            if head:
                up_w.write(head)
            await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
        finally:
            up_w.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await src.read(PIPE_CHUNK)
            if not data:
                break
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (OSError, RuntimeError):
        dst.close()


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        return False


def _cidr_allows(entries: dict, ip: str, port: int) -> bool:
    """Longest-prefix match over compiled entries, as the BPF program does (TCP)."""
    a = ipaddress.IPv4Address(ip)
    best = None
    for net, ranges in entries.items():
        if net.version == 4 and a in net and (best is None or net.prefixlen > best[0].prefixlen):
            best = (net, ranges)
    return best is not None and any(lo <= port <= hi and bits & 1 for lo, hi, bits in best[1])
