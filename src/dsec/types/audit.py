"""The audit log's wire types: who (which API key) did what to what, per project."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

MAX_AUDIT_PAGE = 1000


class AuditEntry(BaseModel):
    id: str = Field(description="sorts by time: pass the last one of a page as ?before= for the next")
    at: datetime
    project: str = Field(description="the project of the key that acted")
    key_id: str = Field(description="the API key that acted (its id, never the secret)")
    action: str = Field(description="what was done, `resource.verb`: sandbox.create, exec.start, file.read, ...")
    target: str = Field("", description="what it was done to: a sandbox, key, project, secret or webhook id/name")
    status: int = Field(description="the HTTP status of the answer (4xx/5xx: refused or failed)")
    details: dict[str, Any] = Field(default_factory=dict,
                                    description="a file's path, the route; never values, command text or contents")


class AuditList(BaseModel):
    entries: list[AuditEntry] = Field(description="newest first")
    next_before: str | None = Field(None, description="pass as ?before= for the next (older) page; null: no more")
