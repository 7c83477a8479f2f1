"""A live sandbox on this edge: its record and everything the edge holds for it while it lives.

One object per sandbox owns the durable record (typed arguments, state, counters), the backend
that runs it, the connection to its agent, its locks and its exec channel counter. Teardown
is `close()`, in one place: nothing is kept in parallel per-sandbox dicts to pop by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from dsec.agent.client import AgentClient
from dsec.backends.base import Backend
from dsec.edge.exec_tracker import ExecTable
from dsec.edge.records import SandboxRecord
from dsec.types import CapacityExceeded, SandboxFailed, SandboxState

# Back-pressure per sandbox: at most EXECS_MAX commands at once, and at most exec_bytes_limit()
# of output they may bring back together (each reserves 2 x its per-stream cap when it starts:
# the agent keeps that much in the sandbox's memory, the edge collects it in its own). Beyond
# either, an exec is refused at once with 429 and Retry-After, never queued without bound.
EXECS_MAX = 64
EXEC_BYTES_MAX = 64 << 20
EXEC_RETRY_AFTER_S = 1
MiB = 1 << 20


class ExecsBusy(CapacityExceeded):
    """The sandbox's exec slots are full: retry after `retry_after_s` (HTTP Retry-After)."""

    retry_after_s = EXEC_RETRY_AFTER_S


def exec_bytes_limit(memory_mb: int) -> int:
    """Output bytes a sandbox's running execs may reserve together: half its memory (the agent
    keeps their output there until delivered), 8..64 MiB."""
    return max(8 << 20, min(EXEC_BYTES_MAX, (memory_mb << 20) // 2))


@dataclass(eq=False)
class LiveSandbox:
    rec: SandboxRecord
    backend: Backend
    agent: AgentClient | None = None
    next_chan: int = 1            # chan 0 is the agent's control channel
    ping_misses: int = 0          # unanswered liveness pings in a row (LivenessWatched backends)
    ping_missed_since: float = 0.0   # monotonic time of the first of them
    execs: int = 0                # execs running now (exec_slot)
    exec_bytes: int = 0           # output they reserved
    parked_where: str = "memory"  # a parked one's memory: "memory" (RAM/swap) or "disk" (metrics)
    commands: ExecTable = field(default_factory=ExecTable)   # detached/keyed execs, running execs' metadata
    # one connect at a time; parking/resuming serialised; network policy changes serialised
    agent_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    park_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    net_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return self.rec.id

    @contextmanager
    def exec_slot(self, reserve: int) -> Iterator[None]:
        """Hold one of the sandbox's exec slots and `reserve` bytes of output for the duration
        of one exec, or raise ExecsBusy (429, Retry-After). One exec alone is always admitted,
        whatever it reserves (a single large output_cap_bytes must not be refused forever)."""
        limit = exec_bytes_limit(self.rec.memory_mb)
        if self.execs >= EXECS_MAX or (self.execs and self.exec_bytes + reserve > limit):
            raise ExecsBusy(
                f"sandbox {self.id} is busy: {self.execs} commands running with {self.exec_bytes / MiB:.1f} MiB "
                f"of output reserved (at most {EXECS_MAX} commands and {limit / MiB:.0f} MiB; each reserves 2 x its "
                f"output cap, this one {reserve / MiB:.1f} MiB)", field="sandbox_id",
                fix=f"retry after {EXEC_RETRY_AFTER_S}s (Retry-After), when running commands have finished; "
                    "or ask for a smaller output_cap_bytes")
        self.execs += 1
        self.exec_bytes += reserve
        try:
            yield
        finally:
            self.execs -= 1
            self.exec_bytes -= reserve

    def take_chan(self) -> int:
        """A fresh exec channel number (never one the agent still retains)."""
        chan = self.next_chan
        self.next_chan += 1
        return chan

    async def connect(self) -> AgentClient:
        """The agent connection, reconnecting if it was lost (e.g. after an edge restart). A
        plain connect to the backend's socket: the sandbox is up (the backend's wait_agent is
        for the first connection, which may wait for a boot)."""
        agent = self.agent
        if agent is not None and not agent.closed:
            return agent
        async with self.agent_lock:
            if self.agent is None or self.agent.closed:
                await self.adopt(await AgentClient.connect(self.backend.agent_socket(self.id)))
            assert self.agent is not None
            return self.agent

    async def adopt(self, agent: AgentClient, fresh: bool = False) -> None:
        """Use `agent` from now on. Chans the agent still retains (from before an edge restart,
        or in a restored guest) are not reused; a `fresh` agent (a process just started) has none."""
        self.agent = agent          # owned from here: close() frees it even if the listing fails
        if fresh:
            return
        execs = await agent.list_execs()
        self.next_chan = max([c for c, _ in execs] + [self.next_chan]) + 1

    async def drop_agent(self) -> None:
        """Close the agent connection (the sandbox is parked or going away)."""
        agent, self.agent = self.agent, None
        if agent is not None:
            await agent.close()

    async def close(self) -> None:
        """Free what the edge holds for this sandbox (the backend frees the sandbox itself). The
        commands it still follows end with the sandbox's failure, when that is why."""
        failed = self.rec.state == SandboxState.failed
        self.commands.close(SandboxFailed(f"sandbox {self.id} failed: {self.rec.error}", field="sandbox_id",
                                          fix="create a new sandbox", reason=self.rec.end_reason) if failed else None)
        await self.drop_agent()
