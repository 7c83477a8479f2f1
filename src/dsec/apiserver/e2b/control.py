"""The control-plane steps of the E2B routes: dsec's own (apiserver/control.py), with E2B's
names for the fields in their errors (sandboxID, templateID)."""

from __future__ import annotations

from dsec.apiserver import control
from dsec.apiserver.context import ApiContext, EdgeHandle
from dsec.iam import Principal
from dsec.iam.policy import check_create, is_root
from dsec.types import ExecRequest, NotFound, SandboxArgs, SandboxInfo


async def owned(ctx: ApiContext, sandbox_id: str, who: Principal) -> tuple[EdgeHandle, SandboxInfo]:
    """The edge and info of a sandbox of the caller's project (others' look missing)."""
    return await control.owned(ctx, sandbox_id, who, field="sandboxID")


async def create(ctx: ApiContext, who: Principal, args: SandboxArgs) -> SandboxInfo:
    """Create on the least-loaded node that admits it, bounded by the project's policy."""
    try:
        return await control.create_sandbox(ctx, who, args)
    except NotFound as e:
        if e.field != "image":
            raise
        # E2B's template is dsec's image
        raise NotFound(f"template {args.image!r} not found: {e.message}", field="templateID",
                       fix=e.fix) from None


def check_exec(ctx: ApiContext, project: str, req: ExecRequest) -> None:
    """Root commands are bounded by the project's policy, like POST .../exec (the project is
    known here already: no lookup)."""
    if is_root(req.user) or req.output_cap_bytes is not None:
        check_create(ctx.iam.effective_policy(project), req, project)
