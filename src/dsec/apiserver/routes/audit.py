"""The audit log (apiserver/audit.py): `GET /v1/audit`, newest first, filtered and paged.

A project's admin keys read its entries and those of the projects below it; the root
project's admin keys read all. Member keys are refused, naming the role (iam.require_admin).
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Query

from dsec.apiserver.audit import audit_log
from dsec.apiserver.deps import Ctx, Who, is_admin
from dsec.iam import require_admin
from dsec.store.audit import Query as AuditQuery
from dsec.types import MAX_AUDIT_PAGE, AuditList, InvalidArgument, NotFound

router = APIRouter()
PROJECT_FIX = "use a project id from `dsec project ls`: your project or one below it"


def _epoch(t: datetime | None, field: str) -> float | None:
    if t is None:
        return None
    try:
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()   # no zone: UTC
    except (ValueError, OverflowError):
        raise InvalidArgument(f"{field}: {t.isoformat()} is out of range", field=field,
                              fix="an ISO 8601 time between the years 1970 and 9999") from None


@router.get("/v1/audit", response_model=AuditList, tags=["audit"])
async def list_audit(
        who: Who, ctx: Ctx,
        project: Annotated[str | None, Query(max_length=128, description="only this project (and not those "
                                                                         "below it)")] = None,
        key_id: Annotated[str | None, Query(max_length=64, description="only what this key did")] = None,
        action: Annotated[str | None, Query(pattern=r"^[a-z_]+(\.[a-z_]*)?$", description="exact (`exec.start`) "
                                            "or a prefix ending in a dot (`file.`)")] = None,
        target: Annotated[str | None, Query(max_length=256, description="only entries about this sandbox, key, "
                                                                         "project, secret or webhook")] = None,
        since: Annotated[datetime | None, Query(description="only entries at or after this time (ISO 8601)")] = None,
        until: Annotated[datetime | None, Query(description="only entries before this time")] = None,
        before: Annotated[str | None, Query(pattern=r"^[0-9a-f]{24}$", description="the `next_before` of the "
                                                                                   "last page")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_AUDIT_PAGE)] = 100) -> AuditList:
    """Who (which key) created, changed, stopped or read what: newest first."""
    require_admin(who, "read the audit log")
    if project is not None:
        if not ctx.iam.can_access(who, project):
            raise NotFound(f"no project {project!r}", field="project", fix=PROJECT_FIX)
        projects: list[str] | None = [project]
    elif is_admin(ctx, who):
        projects = None
    else:
        projects = [p.id for p in await asyncio.to_thread(ctx.iam.subtree, who.project_id)]
    q = AuditQuery(projects=projects, key_id=key_id, action=action, target=target,
                   since=_epoch(since, "since"), until=_epoch(until, "until"), before=before, limit=limit)
    return await asyncio.to_thread(audit_log(ctx).store.query, q)
