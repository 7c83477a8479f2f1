"""Sandboxes: create, list, get, stop; network policy, timeout, console; parking (one and in bulk); layer diffs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query
from fastapi.responses import Response

from dsec.apiserver import control, forks, list_query, listing
from dsec.apiserver.deps import Ctx, Who, owned
from dsec.iam import Principal
from dsec.apiserver.context import ApiContext
from dsec.types import (BulkResult, BulkSelector, ForkRequest, ForkResult, ImageInfo, NetworkPolicy, PackDiffRequest, SandboxArgs, SandboxInfo,
                        SandboxList, SandboxState)
from dsec.types.sandboxes import MAX_LABELS

router = APIRouter()


@router.post("/v1/sandboxes", status_code=201, response_model=SandboxInfo)
async def create_sandbox(args: Annotated[SandboxArgs, Body()], who: Who, ctx: Ctx) -> SandboxInfo:
    """Create a sandbox; `backend` picks the argument type: container (default), microvm, vm."""
    return await control.create_sandbox(ctx, who, args)


@router.get("/v1/sandboxes", response_model=SandboxList)
async def list_sandboxes(
        who: Who, ctx: Ctx, include_ended: bool = False,
        project: Annotated[str | None, Query(max_length=128, description="only this project's sandboxes")] = None,
        label: Annotated[list[str], Query(max_length=MAX_LABELS, description="KEY=VALUE, repeatable: all must "
                                                                              "match")] = [],  # noqa: B006
        state: Annotated[list[SandboxState], Query(description="repeatable: any of them")] = [],  # noqa: B006
        limit: Annotated[int | None, Query(ge=1, le=list_query.MAX_LIMIT, description="at most this many, "
                                                                                       "newest first")] = None,
        offset: Annotated[int, Query(ge=0, description="skip this many (the `next_offset` of the last page)")] = 0,
) -> SandboxList:
    """The caller's sandboxes on every node; a node that does not answer within seconds is
    named in `unreachable_nodes` and its sandboxes listed as last indexed (listing.py).
    With filters or a page, `total` counts the matches and the answer is newest first
    (list_query.py)."""
    q = list_query.SandboxQuery(project=project, labels=list_query.parse_labels(label), states=frozenset(state),
                                limit=limit, offset=offset)
    list_query.check_project(ctx.iam, who, project)
    return list_query.select(await listing.list_sandboxes(ctx, who, include_ended or q.wants_ended), q)


@router.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
async def get_sandbox(sandbox_id: str, who: Who, ctx: Ctx) -> SandboxInfo:
    edge = await owned(ctx, sandbox_id, who)
    return await edge.get(sandbox_id, usage=True)


@router.delete("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
async def stop_sandbox(sandbox_id: str, who: Who, ctx: Ctx) -> SandboxInfo:
    edge = await owned(ctx, sandbox_id, who)
    return await control.stop_sandbox(ctx, edge, sandbox_id)


@router.put("/v1/sandboxes/{sandbox_id}/network", response_model=SandboxInfo)
async def set_network(sandbox_id: str, policy: NetworkPolicy, who: Who, ctx: Ctx) -> SandboxInfo:
    """Replace the egress policy of a running sandbox (effective for new connections at once)."""
    return await control.set_network(ctx, await owned(ctx, sandbox_id, who), sandbox_id, policy)


@router.get("/v1/sandboxes/{sandbox_id}/console", response_class=Response)
async def console(sandbox_id: str, who: Who, ctx: Ctx,
                  tail: Annotated[int, Query(ge=1, le=1 << 20)] = 65536) -> Response:
    """VM sandboxes: the last `tail` bytes of the guest's serial console (kernel messages,
    init errors), also after the VM failed."""
    edge = await owned(ctx, sandbox_id, who)
    return Response(await edge.console(sandbox_id, tail), media_type="text/plain; charset=utf-8")


# before /v1/sandboxes/{sandbox_id}/...: "bulk" is not a sandbox id

async def bulk(ctx: ApiContext, sel: BulkSelector, who: Principal, verb: str) -> BulkResult:
    """The caller's sandboxes with all of sel.labels, on every node, through each edge's bulk
    verb; those of a node that does not answer come back with an error naming it."""
    return await listing.bulk(ctx, who, dict(sel.labels), verb)


@router.post("/v1/sandboxes/bulk/suspend", response_model=BulkResult)
async def suspend_many(sel: BulkSelector, who: Who, ctx: Ctx) -> BulkResult:
    """Park every one of the caller's sandboxes that has all these labels (e.g. a trainer's
    job, on preemption); each one's outcome. Parked ones resume on their next request."""
    return await bulk(ctx, sel, who, "suspend_many")


@router.post("/v1/sandboxes/bulk/resume", response_model=BulkResult)
async def resume_many(sel: BulkSelector, who: Who, ctx: Ctx) -> BulkResult:
    return await bulk(ctx, sel, who, "resume_many")


@router.post("/v1/sandboxes/{sandbox_id}/suspend", response_model=SandboxInfo)
async def suspend(sandbox_id: str, who: Who, ctx: Ctx) -> SandboxInfo:
    """Park the sandbox (a VM saved to disk, a container frozen with its memory pushed to
    compressed swap); the next request to it resumes it."""
    edge = await owned(ctx, sandbox_id, who)
    return await edge.suspend(sandbox_id)


@router.post("/v1/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo)
async def resume(sandbox_id: str, who: Who, ctx: Ctx) -> SandboxInfo:
    edge = await owned(ctx, sandbox_id, who)
    return await edge.resume(sandbox_id)


@router.post("/v1/sandboxes/{sandbox_id}/pack_diff", status_code=201, response_model=ImageInfo)
async def pack_diff(sandbox_id: str, req: PackDiffRequest, who: Who, ctx: Ctx) -> ImageInfo:
    """Snapshot the sandbox's writable changes as a new workspace layer NAME@VERSION."""
    edge = await owned(ctx, sandbox_id, who)
    return await edge.pack_diff(sandbox_id, req)


@router.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, response_model=ForkResult)
async def fork(sandbox_id: str, req: ForkRequest, who: Who, ctx: Ctx) -> ForkResult:
    """Branch a running sandbox into `count` new ones on its node, from one snapshot taken now
    (the parent runs on, same id and lifetime). Each fork succeeds or fails on its own and is
    counted against the project's quota; `not_carried` says what the forks do not have."""
    return await forks.fork(ctx, who, sandbox_id, req.count, req.lifetime_s)
