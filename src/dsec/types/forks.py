"""Fork: one running sandbox branched into N (POST /v1/sandboxes/{id}/fork)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from dsec.types.errors import ErrorDetail
from dsec.types.sandboxes import Lifetime, SandboxInfo, _Strict

MAX_FORKS = 64      # per call: one snapshot, this many creations at once


class ForkRequest(_Strict):
    count: Annotated[int, Field(ge=1, le=MAX_FORKS, description="how many sandboxes to branch off")] = 1
    lifetime_s: Lifetime = Field(None, description="each fork's absolute lifetime; None: the parent's setting "
                                                   "(counted from the fork's creation)")


class ForkItem(BaseModel):
    """One fork's outcome: a running sandbox, or why that one did not start (the others may have)."""

    sandbox: SandboxInfo | None = None
    error: ErrorDetail | None = None
    status: int = Field(201, description="the HTTP status a create of this one alone would have answered")


class ForkResult(BaseModel):
    parent: str = Field(description="the sandbox forked; it runs on unchanged (same id, same lifetime)")
    not_carried: list[str] = Field(description="what of the parent the forks do not have (never silently): "
                                               "containers carry the filesystem, env, workdir, labels, limits "
                                               "and network policy, not the running processes")
    forks: list[ForkItem]
