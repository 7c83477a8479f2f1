"""Nodes and the image registry as the caller may see them; publishing images (admin)."""

from __future__ import annotations

from fastapi import APIRouter

from dsec.apiserver.deps import Ctx, Who, admin_only, is_admin
from dsec.apiserver.tenancy import visible
from dsec.apiserver.node_states import node_states
from dsec.store.nodes import NodeRow
from dsec.types import ImageInfo, ImageList, NodeCapacity, NodeStatus, Unavailable

router = APIRouter()


def with_states(views: list[NodeStatus], rows: dict[str, NodeRow]) -> list[NodeStatus]:
    """The watcher's view with each node's operator state, and the nodes the control store
    knows that are gone (unhealthy, since when) until they are forgotten."""
    out = [v.model_copy(update={"state": rows[v.node_id].state}) if v.node_id in rows else v for v in views]
    seen = {v.node_id for v in views}
    for node, r in sorted(rows.items()):
        if node not in seen and r.state != "forgotten" and r.missing_since is not None:
            out.append(NodeStatus(node_id=node, healthy=False, backends=[], state=r.state,
                                  capacity=NodeCapacity(cpu_cores=0, memory_mb=0, max_sandboxes=0),
                                  missing_since=r.missing_since, reason="gone from the cluster: `dsec nodes "
                                  f"forget {node}` once it will not come back"))
    return out


@router.get("/v1/nodes", response_model=list[NodeStatus])
async def nodes(who: Who, ctx: Ctx) -> list[NodeStatus]:
    views = with_states(ctx.watcher.nodes(), await node_states(ctx).rows())
    if is_admin(ctx, who):
        return views
    # which images a node holds hints at other projects' work: admins only (D34)
    return [n.model_copy(update={"cached_images": frozenset()}) for n in views]


@router.get("/v1/images", response_model=ImageList)
async def images(who: Who, ctx: Ctx) -> ImageList:
    """Images and layers this project may use: its own, its relatives', and published ones."""
    if ctx.images is None:
        raise Unavailable("this apiserver has no image registry attached")
    return ImageList(images=[i for i in ctx.images.list() if visible(ctx.iam, who, i)])


@router.post("/v1/images/{name}/publish", response_model=ImageInfo)
async def publish_image(name: str, who: Who, ctx: Ctx) -> ImageInfo:
    """Admin only: make an image or layer usable by every project (it has no owner then)."""
    if ctx.images is None:
        raise Unavailable("this apiserver has no image registry attached")
    admin_only(ctx, who, "publish images to all projects", "name", fix="ask an admin to publish it")
    ctx.images.get(name, "name")
    return ctx.images.registry.set_owner(name, None)
