"""E2B's fork and snapshot routes on dsec's fork (apiserver/forks.py) and snapshots.

    POST   /sandboxes/{id}/fork        -> forks.fork: one result per fork, {"sandbox"} or {"error"}
    POST   /sandboxes/{id}/snapshots   -> a snapshot; its id is the template a create names
    GET    /snapshots                  -> the project's snapshots (sandboxID filter, pages)
    DELETE /templates/{snapshot id}    -> delete_snapshot (the SDK deletes snapshots as templates)
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated, Any

from fastapi import Body, FastAPI, Query, Request, Response

from dsec.apiserver import forks, snapshot_export
from dsec.apiserver.context import ApiContext
from dsec.apiserver.control import owned_snapshot
from dsec.apiserver.e2b import control, mapping, snapshot_names
from dsec.apiserver.e2b.auth import AccessTokens
from dsec.apiserver.e2b.errors import NotImplementedE2B, Unsupported, e2b_error_body
from dsec.apiserver.e2b.ids import to_dsec
from dsec.apiserver.e2b.models import ForkBody, SnapshotBody
from dsec.apiserver.guard import principal_of
from dsec.iam import Principal
from dsec.types import (ERRORS_BY_CODE, Conflict, MAX_FORKS, MAX_TTL_S, SNAPSHOT_ID_PATTERN, VM_BACKENDS, DsecError,
                        InvalidArgument, NotFound, SandboxState, SnapshotInfo, Unauthorized)

DEFAULT_FORK_TIMEOUT_S = 15      # SandboxForkRequest's documented default


def _who(request: Request) -> Principal:
    p = principal_of(request)
    if p is None:
        raise Unauthorized("no API key", field="X-API-KEY", fix="set E2B_API_KEY to a dsec API key")
    return p


def _listed(s: SnapshotInfo, names: list[str]) -> dict[str, Any]:
    return {"snapshotID": s.id, "names": names}


def _project_name(ctx: ApiContext, project_id: str, who: Principal) -> str:
    """The namespace of a listed snapshot's names: its project's name (a sub-project's own)."""
    if project_id == who.project_id:
        return who.project_name
    try:
        return ctx.iam.project(project_id).name
    except DsecError:
        return project_id


def add_snapshot_routes(app: FastAPI, ctx: ApiContext, tokens: AccessTokens, domain: str | None) -> None:
    async def sandbox_of(e2b_id: str, who: Principal) -> str:
        try:
            _, info = await control.owned(ctx, to_dsec(e2b_id), who)
        except NotFound:
            info = None
        if info is None or mapping.e2b_state(info) is None:
            raise NotFound(f"sandbox {e2b_id} not found", field="sandboxID",
                           fix="it was killed or reached its timeout; list running ones with Sandbox.list()")
        if info.state == SandboxState.suspended:
            raise Conflict(f"sandbox {e2b_id} is paused", field="sandboxID", fix="resume it with connect first")
        return info.id

    @app.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    async def fork(request: Request, sandbox_id: str, body: Annotated[ForkBody | None, Body()] = None) -> list[dict]:
        who = _who(request)
        body = body or ForkBody()
        count = 1 if body.count is None else body.count
        if not 1 <= count <= MAX_FORKS:
            raise InvalidArgument(f"count {count} must be 1..{MAX_FORKS}", field="count",
                                  fix=f"fork at most {MAX_FORKS} at once")
        timeout = DEFAULT_FORK_TIMEOUT_S if body.timeout is None else body.timeout
        if not 0 < timeout <= MAX_TTL_S:
            raise InvalidArgument(f"timeout {timeout} must be 1..{MAX_TTL_S} seconds", field="timeout",
                                  fix="pass at most 604800 (7 days)")
        res = await forks.fork(ctx, who, await sandbox_of(sandbox_id, who), count, timeout)
        # processes are not carried: each container fork starts what the template runs (e.g. Jupyter)
        started = [i.sandbox for i in res.forks if i.sandbox is not None and i.sandbox.backend not in VM_BACKENDS]
        await asyncio.gather(*(control.start_template_services(ctx, s) for s in started))
        out: list[dict] = []
        for item in res.forks:
            if item.sandbox is not None:
                out.append({"sandbox": mapping.created(item.sandbox, tokens, domain)})
            else:
                assert item.error is not None
                cls = ERRORS_BY_CODE.get(item.error.code, DsecError)
                err = cls(item.error.message, field=item.error.field, fix=item.error.fix)
                out.append({"error": e2b_error_body(err)})
        return out

    @app.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    async def create_snapshot(request: Request, sandbox_id: str,
                              body: Annotated[SnapshotBody | None, Body()] = None) -> dict:
        who = _who(request)
        body = body or SnapshotBody()
        name = None
        if body.name:
            name = snapshot_names.checked(body.name, who)
            if snapshot_names.is_image(ctx, who, name.split(":")[0]) or snapshot_names.is_image(ctx, who, name):
                raise Conflict(f"name {body.name!r} is a template's (an image): a create naming it would start "
                               "the image", field="name", fix="pick another name for the snapshot")
        sid = await sandbox_of(sandbox_id, who)
        edge = ctx.edge_for(sid)
        info = await edge.get(sid)
        if body.memory and info.backend not in VM_BACKENDS:
            raise Unsupported("memory: a container snapshot keeps the filesystem, not the processes' memory",
                              field="memory", fix="create_snapshot(mode='filesystem'), or use a microvm sandbox")
        snap = await edge.snapshot(sid, measure=False, name=name)
        return _listed(snap, [f"{who.project_name}/{name}"] if name else [])

    @app.get("/snapshots")
    async def list_snapshots(request: Request, response: Response,
                             sandbox: Annotated[str | None, Query(alias="sandboxID")] = None,
                             name: str | None = None,
                             next_token: Annotated[str | None, Query(alias="nextToken")] = None,
                             limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[dict]:
        who = _who(request)
        snaps = await snapshot_names.all_of(ctx, who)
        held = snapshot_names.holders(snaps)
        if sandbox is not None:
            want = to_dsec(sandbox)
            snaps = [s for s in snaps if s.sandbox_id == want]
        if name is not None:
            snaps = [s for s in snaps if snapshot_names.matches(s, name, held, who)]
        snaps.sort(key=lambda s: (s.created_at, s.id))
        start = 0
        if next_token:
            ids = [s.id for s in snaps]
            if next_token not in ids:
                raise InvalidArgument("nextToken does not name a snapshot of this listing", field="nextToken",
                                      fix="list again from the first page")
            start = ids.index(next_token) + 1
        page = snaps[start:start + limit]
        if start + limit < len(snaps) and page:
            response.headers["x-next-token"] = page[-1].id
        return [_listed(s, snapshot_names.names_of(s, held, _project_name(ctx, s.project, who))) for s in page]

    @app.delete("/templates/{template_id}", status_code=204)
    async def delete_template(request: Request, template_id: str) -> Response:
        """Snapshots only: the SDK's delete_snapshot (templates are managed with dsec's CLI)."""
        if not re.match(SNAPSHOT_ID_PATTERN, template_id):
            raise NotImplementedE2B(f"E2B route DELETE /templates/{template_id[:120]} is not served by dsec",
                                    field="path", fix="delete images with `dsec images rm`; see docs/e2b.md")
        who = _who(request)
        edge = await owned_snapshot(ctx, template_id, who, field="templateID")
        await snapshot_export.delete_snapshot(ctx, edge, template_id)
        return Response(status_code=204)

