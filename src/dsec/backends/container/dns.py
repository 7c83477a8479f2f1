"""The node's DNS forwarder for sandboxes, and the upstream client the egress proxy shares.

nftables sends every sandbox's UDP and TCP port 53, whatever the address, to this forwarder on
the bridge's gateway (network.py); the BPF policy lets port 53 out only for sandboxes with some
egress, so a deny-all sandbox has no DNS at all. Per query the sandbox is known by its source
address (sandboxes hold no CAP_NET_ADMIN and cannot change it):
- unknown address or no egress: REFUSED;
- a policy with domain rules: names outside them are REFUSED (the proxy would refuse them anyway;
  this keeps a sandbox from using DNS itself as a channel to arbitrary names);
- AAAA: an empty answer (the bridge routes IPv4 only; clients then use A at once);
- anything else is relayed to the upstream (DSEC_NET_DNS_UPSTREAM) over the same transport.
Wire format through dnslib (docs/decisions.md, D7); asyncio in the edge's loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

from dnslib import QTYPE, RCODE, DNSRecord

from dsec.types.domains import matches

log = logging.getLogger("dsec.backends.container.dns")

QUERY_TIMEOUT_S = 3.0
MAX_INFLIGHT = 512            # upstream queries at once for the whole node
MAX_TCP_PER_SOURCE = 16       # open DNS-over-TCP connections per sandbox
TTL_MIN_S, TTL_MAX_S = 1, 300


class SandboxView:
    """What the forwarder and the proxy need of one sandbox's policy (network.py builds it)."""

    __slots__ = ("sandbox_id", "egress", "domains", "allows")

    def __init__(self, sandbox_id: str, egress: bool, domains: tuple[str, ...], allows: list) -> None:
        self.sandbox_id, self.egress, self.domains, self.allows = sandbox_id, egress, domains, allows


Lookup = Callable[[str], "SandboxView | None"]


def parse_upstream(value: str, resolv_conf: Path = Path("/etc/resolv.conf")) -> tuple[str, int]:
    """'IP', 'IP:PORT' or '[IPv6]:PORT'; empty: the host's first nameserver."""
    v = value.strip()
    if not v:
        try:
            for line in resolv_conf.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    return parts[1], 53
        except OSError:
            pass
        return "127.0.0.1", 53
    host, port = v, 53
    if v.startswith("["):
        host, _, rest = v[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else 53
    elif v.count(":") == 1:
        host, _, p = v.partition(":")
        port = int(p)
    ipaddress.ip_address(host)   # ValueError for a name: the upstream must be an address
    return host, port


class Upstream:
    """Queries to the configured resolver, UDP (TCP when truncated or asked), bounded in flight."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.addr = addr
        self._sem = asyncio.Semaphore(MAX_INFLIGHT)
        self._cache: dict[str, tuple[float, list[str]]] = {}

    async def query(self, packet: bytes, tcp: bool = False) -> bytes:
        async with self._sem:
            if not tcp:
                reply = await asyncio.wait_for(self._udp(packet), QUERY_TIMEOUT_S)
                if len(reply) >= 4 and not reply[2] & 0x02:   # TC bit clear
                    return reply
            return await asyncio.wait_for(self._tcp(packet), QUERY_TIMEOUT_S)

    async def _udp(self, packet: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        fam = socket.AF_INET6 if ":" in self.addr[0] else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.addr)
            await loop.sock_sendall(sock, packet)
            while True:
                reply = await loop.sock_recv(sock, 65535)
                if reply[:2] == packet[:2]:   # same id: ours (the socket is connected to the upstream)
                    return reply
        finally:
            sock.close()

    async def _tcp(self, packet: bytes) -> bytes:
        reader, writer = await asyncio.open_connection(*self.addr)
        try:
            writer.write(struct.pack(">H", len(packet)) + packet)
            await writer.drain()
            n = struct.unpack(">H", await reader.readexactly(2))[0]
            return await reader.readexactly(n)
        finally:
            writer.close()

    async def resolve4(self, name: str) -> list[str]:
        """IPv4 addresses of a name (following the CNAMEs in the answer), cached for their TTL."""
        now = time.monotonic()
        hit = self._cache.get(name)
        if hit and hit[0] > now:
            return hit[1]
        reply = DNSRecord.parse(await self.query(DNSRecord.question(name, "A").pack()))
        addrs = [str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A]
        ttl = min([rr.ttl for rr in reply.rr] or [TTL_MIN_S])
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[name] = (now + max(TTL_MIN_S, min(TTL_MAX_S, ttl)), addrs)
        return addrs


class Forwarder:
    """The answering logic, shared by the UDP and TCP listeners."""

    def __init__(self, lookup: Lookup, upstream: Upstream) -> None:
        self.lookup = lookup
        self.upstream = upstream

    async def answer(self, packet: bytes, source: str, tcp: bool) -> bytes | None:
        try:
            req = DNSRecord.parse(packet)
        except Exception:   # dnslib raises DNSError and others on garbage: not worth a reply
            return None
        if req.header.qr or not req.questions:
            return None
        view = self.lookup(source)
        if view is None or not view.egress:
            return self._reply(req, RCODE.REFUSED)
        for q in req.questions:
            if view.domains and not matches(str(q.qname), view.domains):
                log.info("DNS name refused", extra={"sandbox": view.sandbox_id, "qname": str(q.qname)[:253]})
                return self._reply(req, RCODE.REFUSED)
        if len(req.questions) == 1 and req.q.qtype == QTYPE.AAAA:
            return self._reply(req, RCODE.NOERROR)   # no IPv6 route: say there is none, at once
        try:
            return await self.upstream.query(packet, tcp=tcp)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            return self._reply(req, RCODE.SERVFAIL)

    @staticmethod
    def _reply(req: DNSRecord, rcode: int) -> bytes:
        r = req.reply()
        r.header.rcode = rcode
        return r.pack()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, fwd: Forwarder) -> None:
        self.fwd = fwd
        self.transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task] = set()

    def connection_made(self, transport) -> None:   # type: ignore[override]
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:   # type: ignore[override]
        if len(self._tasks) >= MAX_INFLIGHT:
            return   # overloaded: drop, the client retries
        t = asyncio.ensure_future(self._serve(data, addr))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _serve(self, data: bytes, addr) -> None:
        try:
            reply = await self.fwd.answer(data, addr[0], tcp=False)
        except Exception:   # one query only, never the listener
            log.warning("DNS query failed", exc_info=True, extra={"source": addr[0]})
            return
        if reply is not None and self.transport is not None:
            if len(reply) > 512 and not DNSRecord.parse(data).ar:   # no EDNS: truncate, client retries on TCP
                r = DNSRecord.parse(data).reply()
                r.header.tc = 1
                reply = r.pack()
            self.transport.sendto(reply, addr)


class SourceSlots:
    """Open connections counted per sandbox address, at most `limit` each (the forwarder's TCP
    and the egress proxy both bound what one sandbox may hold open)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def take(self, source: str) -> bool:
        n = self._open.get(source, 0)
        if n >= self.limit:
            return False
        self._open[source] = n + 1
        return True

    def give_back(self, source: str) -> None:
        n = self._open.get(source, 1) - 1
        if n > 0:
            self._open[source] = n
        else:
            self._open.pop(source, None)


class DnsServer:
    """UDP and TCP listeners on (address, port); start() and stop() from the edge's loop."""

    def __init__(self, lookup: Lookup, upstream: Upstream, address: str, port: int) -> None:
        self.fwd = Forwarder(lookup, upstream)
        self.address, self.port = address, port
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._per_source = SourceSlots(MAX_TCP_PER_SOURCE)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(self.fwd), local_addr=(self.address, self.port))
        self._tcp = await asyncio.start_server(self._serve_tcp, self.address, self.port, reuse_address=True)

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = writer.get_extra_info("peername")[0]
        if not self._per_source.take(source):
            writer.close()
            return
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), 10)
                packet = await asyncio.wait_for(reader.readexactly(struct.unpack(">H", head)[0]), 10)
                reply = await self.fwd.answer(packet, source, tcp=True)
                if reply is None:
                    break
                writer.write(struct.pack(">H", len(reply)) + reply)
                await writer.drain()
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass
        except Exception:
            log.warning("DNS-over-TCP connection failed", exc_info=True, extra={"source": source})
        finally:
            self._per_source.give_back(source)
            writer.close()


