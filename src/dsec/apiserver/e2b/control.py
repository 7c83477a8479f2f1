"""The control-plane steps of the E2B routes: dsec's own (apiserver/control.py), with E2B's
names for the fields in their errors (sandboxID, templateID)."""

from __future__ import annotations

import logging

from dsec.apiserver import control
from dsec.apiserver.context import ApiContext, EdgeHandle
from dsec.apiserver.e2b.mapping import E2B_USER_ENV
from dsec.iam import Principal
from dsec.types import DsecError, ExecRequest, NotFound, SandboxArgs, SandboxInfo

log = logging.getLogger("dsec.apiserver.e2b")

# What an E2B template starts at creation, when its image has it: the code interpreter's server
# on port 49999 (insandbox/code_interpreter_server.py). `--daemon` returns once the port listens,
# so run_code works as soon as create returns; an image without it costs one `test -x`.
TEMPLATE_SERVICES = ("test -x /usr/local/bin/dsec-code-interpreter || exit 0; "
                     "exec /usr/local/bin/dsec-code-interpreter --daemon")


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


# root commands are bounded by the project's policy, like POST .../exec (the project is known
# here already: no lookup)
check_exec = control.check_exec_in


async def start_template_services(ctx: ApiContext, info: SandboxInfo) -> None:
    """Start what E2B templates run by themselves (dsec sandboxes start nothing but their agent).
    A service that fails to start is logged, not fatal: the sandbox itself is fine."""
    try:
        # as the default user, in its home (the workdir): the kernel's cwd and HOME are /home/user
        r = await ctx.edge_for(info.id).run(info.id, ExecRequest(cmd=TEMPLATE_SERVICES, env=E2B_USER_ENV,
                                                                 timeout_s=30))
    except DsecError as e:
        log.warning("template services did not start", extra={"sandbox": info.id, "error": e.message})
        return
    if r.exit_code != 0:
        log.warning("template services did not start", extra={"sandbox": info.id, "exit_code": r.exit_code,
                                                                "stderr": r.stderr[-500:]})
