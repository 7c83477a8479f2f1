"""A TCP listener on the gateway that sandboxes connect to (the egress proxy, the package cache).

What both need around each connection: the sandbox known by its source address (sandboxes
cannot change it), at most `max_per_source` open connections per sandbox, every connection's
task tracked so stop() ends them, and a failure that ends that connection only, never the loop.
Subclasses answer one connection in `_handle`.
"""

from __future__ import annotations

import asyncio
import logging

from dsec.backends.container.dns import SourceSlots

# a sandbox's or an upstream's connection that ended or was malformed: nothing to log
QUIET = (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)


class SandboxListener:
    max_per_source = 64
    stream_limit = 1 << 16     # the StreamReader's buffer (readuntil's bound)
    what = "sandbox listener"  # in the log line of an unexpected failure

    def __init__(self, address: str, port: int) -> None:
        self.address, self.port = address, port
        self._server: asyncio.Server | None = None
        self._slots = SourceSlots(self.max_per_source)
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.address, self.port, reuse_address=True,
                                                  backlog=1024, limit=self.stream_limit)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._tasks):
            t.cancel()

    async def _handle(self, source: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        source = writer.get_extra_info("peername")[0]
        if not self._slots.take(source):
            writer.close()
            return
        try:
            await self._handle(source, reader, writer)
        except QUIET:
            pass
        except Exception:   # e.g. a malformed upstream answer: this connection only, never the loop
            logging.getLogger(type(self).__module__).warning("%s connection failed", self.what, exc_info=True,
                                                             extra={"source": source})
        finally:
            self._slots.give_back(source)
            if not writer.is_closing():
                writer.close()
            if task is not None:
                self._tasks.discard(task)
