"""The one small interface every backend driver implements.

The edge owns admission, records, TTL and the agent channel; a driver only turns a spec into
a running sandbox whose agent listens on `agent_socket(id)`, and frees everything again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Driver(Protocol):
    backend: str

    async def create(self, sandbox_id: str, spec: Any) -> None:
        """Start the sandbox; on failure raise and leave nothing behind."""

    async def destroy(self, sandbox_id: str) -> None:
        """Kill and free everything of the sandbox. Idempotent: absent parts are fine."""

    async def pause(self, sandbox_id: str) -> None:
        """Freeze every process of the sandbox."""

    async def resume(self, sandbox_id: str) -> None: ...

    async def is_running(self, sandbox_id: str) -> bool: ...

    async def list_ids(self) -> dict[str, str]:
        """Sandboxes the runtime itself knows about, with their status (finds orphans after a crash)."""

    def agent_socket(self, sandbox_id: str) -> Path: ...
