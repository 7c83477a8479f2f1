"""Volumes: create, list, delete (of the caller's own project). A volume lives on the node that
keeps it: in a single-machine deployment the one edge, in a cluster whose nodes share
DSEC_VOLUMES_DIR any node (they read the same records)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter
from fastapi.responses import Response

from dsec.apiserver.context import ApiContext, EdgeHandle
from dsec.apiserver.deps import Ctx, Who
from dsec.types import Conflict, NodeUnreachable, NotFound, Unavailable, VolumeCreate, VolumeInfo, VolumeList

router = APIRouter()
log = logging.getLogger("dsec.apiserver")


def volume_edge(ctx: ApiContext) -> EdgeHandle:
    """The edge that answers for volumes: the first node (every node reads the shared root)."""
    for _, edge in sorted(ctx.edges.items()):
        return edge
    raise Unavailable("no node is up to keep volumes", fix="start a node (dsec up), then retry")


@router.post("/v1/volumes", status_code=201, response_model=VolumeInfo)
async def create_volume(req: VolumeCreate, who: Who, ctx: Ctx) -> VolumeInfo:
    """A named directory of the caller's project with a byte quota (size_mb), mounted into its
    sandboxes with `volumes=[{"name", "path", "read_only"}]`; it outlives them."""
    return await volume_edge(ctx).create_volume(who.project_id, req)


@router.get("/v1/volumes", response_model=VolumeList)
async def list_volumes(who: Who, ctx: Ctx, usage: bool = False) -> VolumeList:
    """The caller's project's volumes; usage=true also measures what each holds."""
    return VolumeList(volumes=await volume_edge(ctx).list_volumes(who.project_id, usage))


@router.delete("/v1/volumes/{name}", status_code=204)
async def delete_volume(name: str, who: Who, ctx: Ctx) -> Response:
    """Delete a volume and its files; refused (409) while a sandbox mounts it, on any node."""
    await delete_volume_everywhere(ctx, who.project_id, name)
    return Response(status_code=204)


async def delete_volume_everywhere(ctx: ApiContext, project: str, name: str) -> None:
    """Delete a volume unless a sandbox of any node mounts it (dsec's and E2B's routes)."""
    keeper = volume_edge(ctx)
    await _refuse_if_held(ctx, keeper, project, name)
    await keeper.delete_volume(project, name)       # checks its own node's sandboxes again


async def _refuse_if_held(ctx: ApiContext, keeper: EdgeHandle, project: str, name: str) -> None:
    """Nodes sharing DSEC_VOLUMES_DIR mount one volume from several nodes: every other node is
    asked for its sandboxes mounting it (a node that does not answer is skipped, logged: a
    node gone for good must not pin a volume). A create racing the delete is not excluded."""
    others = [e for _, e in sorted(ctx.edges.items()) if e is not keeper]

    async def held(edge: EdgeHandle) -> list[str]:
        try:
            return await edge.volume_holders(project, name)
        except (NodeUnreachable, NotFound) as e:      # NotFound: an edge of a release without the verb
            log.warning("volume delete: a node did not say whether it mounts the volume",
                        extra={"volume": name, "error": e.message})
            return []
    holders = sorted(s for ids in await asyncio.gather(*(held(e) for e in others)) for s in ids)
    if holders:
        raise Conflict(f"volume {name!r} is mounted by {len(holders)} sandbox(es): {', '.join(holders[:5])}",
                       field="name", fix="stop those sandboxes first, then delete the volume")
