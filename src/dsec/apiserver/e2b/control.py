"""The control-plane steps of the E2B routes: dsec's own (apiserver/control.py), with E2B's
names for the fields in their errors (sandboxID, templateID)."""

from __future__ import annotations

import asyncio
import logging

from dsec.apiserver import control
from dsec.apiserver.context import ApiContext, EdgeHandle
from dsec.apiserver.e2b.mapping import E2B_USER_ENV
from dsec.apiserver.tenancy import visible
from dsec.iam import Principal
from dsec.types import DsecError, ExecRequest, NotFound, SandboxArgs, SandboxInfo

log = logging.getLogger("dsec.apiserver.e2b")

# What an E2B template starts at creation, when its image has it: the code interpreter's server
# on port 49999 (insandbox/code_interpreter_server.py). `--daemon` returns once the port listens,
# so run_code works as soon as create returns; an image without it costs one `test -x`.
# A template built with set_start_cmd / set_ready_cmd (templates.py) has them as scripts in
# /etc/dsec-template: the start command is left running in a session of its own, and creation
# waits (up to 20 s) for the ready command to succeed, as E2B's templates start ready.
TEMPLATE_SERVICES = ("d=/etc/dsec-template; if [ -x $d/start.sh ]; then "
                     "(setsid $d/start.sh </dev/null >>/tmp/dsec-template-start.log 2>&1 &); fi; "
                     "if [ -x $d/ready.sh ]; then i=0; until $d/ready.sh >/dev/null 2>&1; do "
                     "i=$((i+1)); [ $i -ge 100 ] && break; sleep 0.2; done; fi; "
                     "test -x /usr/local/bin/dsec-code-interpreter || exit 0; "
                     "exec /usr/local/bin/dsec-code-interpreter --daemon")


async def with_image_config(ctx: ApiContext, who: Principal, args: SandboxArgs) -> SandboxArgs:
    """A template built from steps or a Dockerfile runs with its ENV (the create's envVars win)
    and WORKDIR, as E2B starts a template's sandboxes (dsec's own API leaves that to the caller)."""
    images = ctx.images
    if images is None:
        return args
    info = images.registry.get_image(args.image)
    if info is None or not visible(ctx.iam, who, info):
        return args       # creation answers for a missing or hidden image
    from dsec.images.dockerfile import image_config
    cfg = await asyncio.to_thread(image_config, images, args.image)
    update: dict[str, object] = {}
    if cfg.env:
        update["env"] = {**cfg.env, **args.env}
    if cfg.workdir and hasattr(args, "workdir"):
        update["workdir"] = cfg.workdir
    return args.model_copy(update=update) if update else args


async def owned(ctx: ApiContext, sandbox_id: str, who: Principal) -> tuple[EdgeHandle, SandboxInfo]:
    """The edge and info of a sandbox of the caller's project (others' look missing)."""
    return await control.owned(ctx, sandbox_id, who, field="sandboxID")


async def create(ctx: ApiContext, who: Principal, args: SandboxArgs,
                 inline_secrets: list | None = None) -> SandboxInfo:
    """Create on the least-loaded node that admits it, bounded by the project's policy
    (`inline_secrets`: E2B's network.rules transforms, for this sandbox only)."""
    try:
        return await control.create_sandbox(ctx, who, args, inline_secrets)
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
