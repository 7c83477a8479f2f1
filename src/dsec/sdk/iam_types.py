"""The IAM API's wire types (projects, quotas, keys): what /v1/projects and /v1/keys send
and answer, shared by the apiserver (apiserver/iam_routes.py) and the SDK."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class ProjectInfo(BaseModel):
    id: str
    name: str
    parent_id: str | None
    max_sandboxes: int = Field(description="sandboxes the project and its sub-projects may hold at once")
    max_cpu_cores: float = Field(description="CPU cores (sum of cpu_cores) they may hold at once")
    max_memory_mb: int = Field(description="memory (sum of memory_mb, MiB) they may hold at once")
    created_at: datetime


class ProjectList(BaseModel):
    projects: list[ProjectInfo]


class QuotaUpdate(BaseModel):
    """Omitted fields stay as they are. Never more than the parent project holds."""

    model_config = ConfigDict(extra="forbid")

    max_sandboxes: Annotated[int | None, Field(ge=0)] = None
    max_cpu_cores: Annotated[float | None, Field(ge=0)] = None
    max_memory_mb: Annotated[int | None, Field(ge=0)] = None


class ProjectCreate(QuotaUpdate):
    """A sub-project; omitted quotas inherit the parent's, and may not exceed them."""

    name: Annotated[str, Field(pattern=NAME, description="unique among its siblings")]
    parent_id: str | None = Field(None, description="default: the caller's own project")


class QuotaUsage(BaseModel):
    sandboxes: int
    cpu_cores: float
    memory_mb: int


class QuotaInfo(BaseModel):
    """A project's limits and what it and its sub-projects hold now, on every node."""

    project_id: str
    max_sandboxes: int
    max_cpu_cores: float
    max_memory_mb: int
    used: QuotaUsage


class KeyInfo(BaseModel):
    id: str
    project_id: str
    prefix: str = Field(description="the key's first characters, to recognise it")
    created_at: datetime
    revoked: bool
    expires_at: datetime | None = Field(None, description="a rotated key ends then (its grace period)")
    role: str = Field("admin", description="admin: manages the project's keys and reads its audit log; "
                                           "member: uses sandboxes only")


class KeyList(BaseModel):
    keys: list[KeyInfo]


class NewKey(KeyInfo):
    key: str = Field(description="the secret: shown once, only its hash is stored")
