"""What the FnCall service needs of the node it runs on: a narrow "sandbox host".

The node's edge is one (dsec.edge.Edge satisfies this structurally); FnCall knows nothing else
of it, so the edge does not know FnCall either. Wired in the composition root (dsec.embedded).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol

from dsec.agent.client import AgentClient
from dsec.types import ImageInfo, SandboxArgs, SandboxInfo


class SandboxHost(Protocol):
    async def create(self, project: str, args: SandboxArgs) -> SandboxInfo: ...
    async def stop(self, sandbox_id: str, reason: str | None = None) -> SandboxInfo: ...
    async def list(self, project: str | None = None, include_ended: bool = False) -> list[SandboxInfo]: ...
    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = ..., mkdirs: bool = ...) -> None: ...
    async def read_file(self, sandbox_id: str, path: str, maxlen: int = ...) -> bytes: ...
    async def resolve_image(self, name: str, field: str = ...) -> ImageInfo: ...

    def agent_channel(self, sandbox_id: str) -> AbstractAsyncContextManager[tuple[AgentClient, int]]:
        """(agent, a fresh exec chan) of a running sandbox, busy while held."""
        ...
