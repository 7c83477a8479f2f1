"""Project sandbox policies: read and replace (iam/policy.py)."""

from __future__ import annotations

from fastapi import APIRouter

from dsec.apiserver.deps import Ctx, Who
from dsec.iam.policy import EffectivePolicy, SandboxPolicy
from dsec.types import NotFound

router = APIRouter()


@router.get("/v1/projects/{project_id}/policy", response_model=EffectivePolicy)
async def get_policy(project_id: str, who: Who, ctx: Ctx) -> EffectivePolicy:
    """A project's own sandbox policy and the effective one (narrowed by its ancestors)."""
    if not ctx.iam.can_access(who, project_id):
        raise NotFound(f"no project {project_id!r}", field="project_id", fix="check the id and API key")
    return EffectivePolicy(project_id=project_id, own=ctx.iam.own_policy(project_id),
                           effective=ctx.iam.effective_policy(project_id))


@router.put("/v1/projects/{project_id}/policy", response_model=EffectivePolicy)
async def set_policy(project_id: str, policy: SandboxPolicy, who: Who, ctx: Ctx) -> EffectivePolicy:
    """Replace a project's own sandbox policy (from a key of a parent project; it may only
    narrow the parent's). Applies to new sandboxes and later set_network calls."""
    if not ctx.iam.can_access(who, project_id):
        raise NotFound(f"no project {project_id!r}", field="project_id", fix="check the id and API key")
    ctx.iam.set_policy(project_id, policy, by=who)
    return EffectivePolicy(project_id=project_id, own=ctx.iam.own_policy(project_id),
                           effective=ctx.iam.effective_policy(project_id))
