"""The E2B REST request bodies dsec reads (e2b.api.client.models, by their JSON names).

Unknown fields are refused (400 naming them) rather than dropped: a field dsec does not know
is one it cannot honour.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _E2B(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class NewSandbox(_E2B):
    """NewSandbox / NewSandboxV2 (POST /sandboxes, POST /v2/sandboxes)."""

    template_id: str = Field(alias="templateID", min_length=1, max_length=256)
    timeout: int | None = None
    auto_pause: bool | None = Field(None, alias="autoPause")
    auto_pause_memory: bool | None = Field(None, alias="autoPauseMemory")
    auto_resume: dict[str, Any] | None = Field(None, alias="autoResume")
    secure: bool | None = None
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None
    volume_mounts: list[dict[str, Any]] | None = Field(None, alias="volumeMounts")


class TimeoutBody(_E2B):
    """SandboxTimeoutRequest (POST /sandboxes/{id}/timeout)."""

    timeout: int


class ConnectBody(_E2B):
    """ConnectSandboxV2 / ResumedSandbox (POST .../connect, .../resume)."""

    timeout: int | None = None
    memory: bool | None = None
    auto_pause: bool | None = Field(None, alias="autoPause")


class PauseBody(_E2B):
    """SandboxPauseRequest (POST /sandboxes/{id}/pause)."""

    memory: bool | None = None
    require_healthy_guest: bool | None = Field(None, alias="requireHealthyGuest")


class ForkBody(_E2B):
    """SandboxForkRequest (POST /sandboxes/{id}/fork)."""

    timeout: int | None = None
    count: int | None = None


class SnapshotBody(_E2B):
    """SandboxSnapshotRequest (POST /sandboxes/{id}/snapshots)."""

    name: str | None = None
    memory: bool | None = None
