"""A live sandbox on this edge: its record and everything the edge holds for it while it lives.

One object per sandbox owns the durable record (typed arguments, state, counters), the backend
that runs it, the connection to its agent, its locks and its exec channel counter. Teardown
is `close()`, in one place: nothing is kept in parallel per-sandbox dicts to pop by hand.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dsec.agent.client import AgentClient
from dsec.backends.base import Backend
from dsec.edge.records import SandboxRecord


@dataclass(eq=False)
class LiveSandbox:
    rec: SandboxRecord
    backend: Backend
    agent: AgentClient | None = None
    next_chan: int = 0
    ping_misses: int = 0          # unanswered liveness pings in a row (LivenessWatched backends)
    # one connect at a time; parking/resuming serialised; network policy changes serialised
    agent_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    park_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    net_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return self.rec.id

    def take_chan(self) -> int:
        """A fresh exec channel number (never one the agent still retains)."""
        chan = self.next_chan
        self.next_chan += 1
        return chan

    async def connect(self) -> AgentClient:
        """The agent connection, reconnecting if it was lost (e.g. after an edge restart)."""
        agent = self.agent
        if agent is not None and not agent.closed:
            return agent
        async with self.agent_lock:
            if self.agent is None or self.agent.closed:
                await self.adopt(await AgentClient.connect(self.backend.agent_socket(self.id)))
            assert self.agent is not None
            return self.agent

    async def adopt(self, agent: AgentClient) -> None:
        """Use `agent` from now on. Chans the agent still retains (from before an edge restart,
        or in a restored guest) are not reused."""
        self.agent = agent          # owned from here: close() frees it even if the listing fails
        execs = await agent.list_execs()
        self.next_chan = max([c for c, _ in execs] + [self.next_chan]) + 1

    async def drop_agent(self) -> None:
        """Close the agent connection (the sandbox is parked or going away)."""
        agent, self.agent = self.agent, None
        if agent is not None:
            await agent.close()

    async def close(self) -> None:
        """Free what the edge holds for this sandbox (the backend frees the sandbox itself)."""
        await self.drop_agent()
