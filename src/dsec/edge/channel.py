"""The agent channel: using a running sandbox's agent (reconnecting, resuming a parked
sandbox first), and marking activity.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from dsec.agent.client import AgentClient, AgentDisconnected
from dsec.backends.base import Doze
from dsec.edge.live import LiveSandbox
from dsec.edge.records import SandboxRecord
from dsec.types import SandboxFailed, SandboxState
from dsec.edge.core import EdgeCore


class AgentChannel(EdgeCore):
    async def _check_alive(self, live: LiveSandbox, cause: BaseException) -> None:
        rec = live.rec
        if rec.state == SandboxState.failed:       # failed meanwhile (e.g. a hung VM)
            raise SandboxFailed(f"sandbox {rec.id} failed: {rec.error}", field="sandbox_id",
                                fix="create a new sandbox", reason=rec.end_reason) from cause
        if not await live.backend.is_running(rec.id):
            await self._fail(live, live.backend.end_reason(rec.id, cause), live.backend.end_code(rec.id))
            raise SandboxFailed(f"sandbox {rec.id} failed: {rec.error}", field="sandbox_id",
                                fix="create a new sandbox", reason=rec.end_reason) from cause

    def _touch(self, rec: SandboxRecord) -> None:
        rec.last_active_at = time.time()
        self._dirty.add(rec.id)

    def _flush_activity(self) -> None:
        """Activity times and output counters of the sandboxes used since the last flush, in
        one write (an exec must not cost a SQLite write of its own)."""
        items = [(live.rec.last_active_at, live.rec.output_used_bytes, i)
                 for i in self._dirty if (live := self._live.get(i)) is not None]
        self._dirty.clear()
        if items:
            self.records.flush_activity(items)

    @asynccontextmanager
    async def _use(self, sandbox_id: str) -> AsyncIterator[tuple[LiveSandbox, AgentClient]]:
        """An agent for a running sandbox; marks activity; turns a dead channel into a failure.
        A parked sandbox is resumed first: callers never see `suspended`; a dozing one (Doze)
        is woken."""
        live = await self._live_resumed(sandbox_id)
        with self._busy(live.rec):
            try:
                try:
                    woke = isinstance(live.backend, Doze) and await live.backend.wake(live.id)
                    agent = await live.connect()
                    if woke:     # its clock stood still while it dozed
                        await agent.refresh(seed=secrets.token_bytes(32), time_ns=time.time_ns())
                except (OSError, AgentDisconnected, asyncio.TimeoutError) as e:
                    await self._check_alive(live, e)
                    raise
                yield live, agent
            except AgentDisconnected as e:
                await self._check_alive(live, e)
                # a dying sandbox closes the channel a moment before its runtime is seen to exit (exit
                # watch, crun state): look again shortly, so the caller gets the real reason
                await asyncio.sleep(0.3)
                await self._check_alive(live, e)
                raise SandboxFailed(f"lost the channel to sandbox {sandbox_id}'s agent; retry the request",
                                    fix="retry; if it persists the sandbox is marked failed") from e

    @contextmanager
    def _busy(self, rec: SandboxRecord) -> Iterator[None]:
        """The sandbox is in use meanwhile: never idle-reaped, parked or reclaimed; activity marked
        at both ends."""
        rec.in_flight += 1
        self._touch(rec)
        try:
            yield
        finally:
            rec.in_flight -= 1
            self._touch(rec)

    @asynccontextmanager
    async def agent_channel(self, sandbox_id: str) -> AsyncIterator[tuple[AgentClient, int]]:
        """(agent, exec chan) of a running sandbox, for a service that drives the agent itself
        (FnCall's long-lived zygote exec). The sandbox counts as busy while this is held."""
        async with self._use(sandbox_id) as (live, agent):
            yield agent, live.take_chan()

    async def _live_resumed(self, sandbox_id: str) -> LiveSandbox:
        """A running sandbox; a parked one is resumed first (callers never see `suspended`)."""
        if self._record(sandbox_id).state == SandboxState.suspended:
            await self.resume(sandbox_id)
        return self._running(sandbox_id)
