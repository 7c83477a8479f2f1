"""The client side of SOCKS5 (RFC 1928 CONNECT, RFC 1929 username/password), as the node's
egress proxy speaks it to a sandbox's egress_proxy. Any answer but success raises SocksRefused:
the caller then closes the sandbox's connection (fail-closed)."""

from __future__ import annotations

import asyncio
import ipaddress
import struct


class SocksRefused(Exception):
    pass


REPLIES = {1: "general failure", 2: "not allowed by ruleset", 3: "network unreachable", 4: "host unreachable",
           5: "connection refused", 6: "TTL expired", 7: "command not supported", 8: "address type not supported"}


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (NetworkPolicy.egress_proxy.address, validated there) -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host, int(port)


async def socks_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: str, port: int,
                        auth: tuple[str, str] | None) -> None:
    """Negotiate and CONNECT to target (an IPv4 address or a name, sent as a name) and port."""
    methods = b"\x00\x02" if auth else b"\x00"
    writer.write(b"\x05" + bytes([len(methods)]) + methods)
    await writer.drain()
    ver, method = await reader.readexactly(2)
    if ver != 5:
        raise SocksRefused("not a SOCKS5 server")
    if method == 2 and auth:
        user, password = (x.encode() for x in auth)
        writer.write(b"\x01" + bytes([len(user)]) + user + bytes([len(password)]) + password)
        await writer.drain()
        _, status = await reader.readexactly(2)
        if status != 0:
            raise SocksRefused("username/password rejected")
    elif method != 0:
        raise SocksRefused("no acceptable authentication method" + ("" if auth else " (no credentials were given)"))
    try:
        dst = b"\x01" + ipaddress.IPv4Address(target).packed
    except ValueError:
        name = target.encode("idna")
        dst = b"\x03" + bytes([len(name)]) + name
    writer.write(b"\x05\x01\x00" + dst + struct.pack(">H", port))
    await writer.drain()
    ver, rep, _, atyp = await reader.readexactly(4)
    if ver != 5 or rep != 0:
        raise SocksRefused(f"CONNECT refused: {REPLIES.get(rep, rep)}")
    if atyp == 1:
        await reader.readexactly(4 + 2)
    elif atyp == 4:
        await reader.readexactly(16 + 2)
    elif atyp == 3:
        n = (await reader.readexactly(1))[0]
        await reader.readexactly(n + 2)
    else:
        raise SocksRefused("malformed CONNECT reply")
