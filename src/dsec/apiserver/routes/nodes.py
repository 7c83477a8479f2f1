"""Nodes and the image registry as the caller may see them; publishing images (admin)."""

from __future__ import annotations

from fastapi import APIRouter

from dsec.apiserver.deps import Ctx, Who, admin_only, is_admin
from dsec.apiserver.tenancy import visible
from dsec.types import ImageInfo, ImageList, NodeStatus, Unavailable

router = APIRouter()


@router.get("/v1/nodes", response_model=list[NodeStatus])
async def nodes(who: Who, ctx: Ctx) -> list[NodeStatus]:
    views = ctx.watcher.nodes()
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
