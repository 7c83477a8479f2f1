"""Fork: one snapshot of a running sandbox, then `count` sandboxes made from it on the same
node, each created (and counted against the project's quota) on its own: one fork's refusal
does not undo the others. The snapshot is deleted once the forks exist; its files stay for as
long as a fork stacks them (backends/container/snapshots.py, the VM snapshot chains)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import TypeAdapter

from dsec.apiserver import control
from dsec.apiserver.context import ApiContext
from dsec.iam import Principal
from dsec.iam.policy import check_create
from dsec.types import (VM_BACKENDS, Conflict, DsecError, ErrorDetail, ForkItem, ForkResult, SandboxArgs,
                        SandboxInfo, SandboxState, SnapshotInfo)

log = logging.getLogger("dsec.apiserver.forks")

_ARGS: TypeAdapter[Any] = TypeAdapter(SandboxArgs)

# what a fork does not get of its parent, per backend (said in every answer, never silently)
NOT_CARRIED = {
    "container": ["processes (running commands, servers, their memory and open connections): a container fork "
                  "starts with the parent's filesystem and settings and only its agent running; start services "
                  "again in each fork"],
}
VM_NOT_CARRIED = ["env and user given at the parent's create (defaults of its later commands); the guest "
                  "itself, its memory, running programs and files, is carried"]


async def fork(ctx: ApiContext, who: Principal, sandbox_id: str, count: int,
               lifetime_s: int | None = None) -> ForkResult:
    edge, info = await control.owned(ctx, sandbox_id, who)
    if info.state != SandboxState.running:
        raise Conflict(f"sandbox {sandbox_id} is {info.state.value}: only a running sandbox forks",
                       field="sandbox_id", fix="resume it first (POST /v1/sandboxes/{id}/resume)")
    snap = await edge.snapshot(sandbox_id, measure=False)
    try:
        args = fork_args(info, snap, lifetime_s)
        check_create(ctx.iam.effective_policy(who.project_id), args, who.project_id)
        outcomes = await asyncio.gather(*(control.create_on(ctx, edge, who, args) for _ in range(count)),
                                        return_exceptions=True)
    finally:
        # the forks hold their own use of its files; the name goes now (not listed, not reusable)
        try:
            await asyncio.shield(edge.delete_snapshot(snap.id))
        except DsecError as e:
            log.warning("could not delete a fork's snapshot", extra={"snapshot": snap.id, "error": e.message})
    items = [_item(o) for o in outcomes]
    log.info("forked", extra={"sandbox": sandbox_id, "count": count,
                              "ok": sum(1 for i in items if i.sandbox is not None)})
    return ForkResult(parent=sandbox_id, forks=items,
                      not_carried=VM_NOT_CARRIED if info.backend in VM_BACKENDS else NOT_CARRIED.get(info.backend, []))


def fork_args(info: SandboxInfo, snap: SnapshotInfo, lifetime_s: int | None) -> Any:
    """A create of one fork: the snapshot says the rest (containers: the parent's args); the
    sizes are named so that the quota reservation counts what the fork will take."""
    raw: dict[str, Any] = {"backend": info.backend, "image": info.image, "snapshot": snap.id,
                           "memory_mb": info.memory_mb, "labels": dict(info.labels)}
    if info.backend in VM_BACKENDS:
        raw["vcpus"] = max(1, int(info.cpu_cores))
    else:
        raw["cpu_cores"] = info.cpu_cores
    if lifetime_s is not None:
        raw["lifetime_s"] = lifetime_s
    return _ARGS.validate_python(raw)


def _item(outcome: SandboxInfo | BaseException) -> ForkItem:
    if isinstance(outcome, SandboxInfo):
        return ForkItem(sandbox=outcome)
    if isinstance(outcome, DsecError):
        return ForkItem(status=outcome.status, error=ErrorDetail(code=outcome.code, message=outcome.message,
                                                                 field=outcome.field, fix=outcome.fix))
    if not isinstance(outcome, Exception):
        raise outcome          # cancellation goes on as it is
    log.error("a fork failed unexpectedly", exc_info=outcome)
    return ForkItem(status=500, error=ErrorDetail(code="internal", message=f"fork failed: {outcome!r}", field=None,
                                                  fix="retry; if it persists, report it with the server log"))
