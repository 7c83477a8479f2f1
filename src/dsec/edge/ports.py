"""Port ingress: a TCP connection to a port inside a sandbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dsec.backends.base import PortIngress
from dsec.types import InvalidArgument, Unavailable
from dsec.edge.core import EdgeCore


class Ports(EdgeCore):
    @asynccontextmanager
    async def port_connection(self, sandbox_id: str, port: int
                              ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        """A TCP connection to `port` inside the sandbox, for the apiserver's HTTP/WebSocket
        ingress. The sandbox counts as busy (never idle-reaped) while it is open; a parked one
        is resumed first. Closed on exit."""
        if not 0 < port < 65536:
            raise InvalidArgument(f"port {port} is not a TCP port", field="port", fix="use 1..65535")
        live = await self._live_resumed(sandbox_id)
        ingress = self._capability(live.rec, PortIngress, "reach its ports")
        with self._busy(live.rec):
            try:
                reader, writer = await ingress.open_port(sandbox_id, port)
            except ConnectionRefusedError:
                raise Unavailable(f"nothing listens on port {port} in sandbox {sandbox_id}", field="port",
                                  fix="start the server inside the sandbox (listening on 127.0.0.1 or 0.0.0.0) "
                                      "and retry") from None
            except FileNotFoundError:
                await self._check_alive(live, ConnectionError("sandbox gone"))
                raise
            try:
                yield reader, writer
            finally:
                writer.close()
                try:
                    await writer.wait_closed()
                except OSError:
                    pass
