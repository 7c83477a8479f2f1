"""Images and layers belong to projects: who may see and use which.

A layer a sandbox packs (pack_diff) is owned by the sandbox's project. It is visible to that
project, to the projects below it (a team's workspaces serve its sub-projects) and to those
above it (a parent already controls its children's sandboxes). Images the operator builds or
imports, and images an admin publishes, have no owner: every project sees them. To anyone else
an owned image looks missing (404 naming the field), as another project's sandboxes do.
"""

from __future__ import annotations

from typing import Any

from dsec.apiserver.context import EdgeHandle
from dsec.iam import IAM, Principal
from dsec.images.service import ImageService
from dsec.types import ImageInfo, NotFound


def visible(iam: IAM, who: Principal, info: ImageInfo) -> bool:
    if info.owner is None:
        return True
    return info.owner in iam.ancestors(who.project_id) or iam.can_access(who, info.owner)


def image_refs(args: Any) -> list[tuple[str, str]]:
    """(field, name) of every image a sandbox would be composed of: image, workspace, toolkits."""
    refs = [("image", args.image)]
    if getattr(args, "workspace", None):
        refs.append(("workspace", args.workspace))
    refs += [(f"toolkits[{i}]", name) for i, name in enumerate(getattr(args, "toolkits", []))]
    return refs


def unusable(field: str, name: str, usable: list[str] | None = None) -> NotFound:
    """The one answer for an image the caller may not use, whether it is missing or another
    project's: the two must not be told apart (issue 22, item 8). `usable`: names the caller
    may use, to suggest."""
    some = f"use one of: {', '.join(usable[:5])}{', ...' if len(usable) > 5 else ''}; or " if usable else "use "
    return NotFound(f"no {field.split('[')[0].rstrip('s')} {name!r} for this project ({field})",
                    field=field, fix=some + "an image or layer of your project (or one published to all); "
                                            "list them with `dsec image ls`")


def check_visible(iam: IAM, who: Principal, field: str, name: str, info: ImageInfo,
                  images: ImageService | None = None) -> None:
    """NotFound naming the field, the same as a missing image, unless the caller may see it."""
    if not visible(iam, who, info):
        raise unusable(field, name, _usable(iam, who, images))


def _usable(iam: IAM, who: Principal, images: ImageService | None) -> list[str] | None:
    if images is None:
        return None
    return [i.name for i in images.list() if i.kind == "image" and visible(iam, who, i)][:6]


def check_usable(iam: IAM, images: ImageService, who: Principal, args: Any) -> list[ImageInfo]:
    """Every image a sandbox would be composed of (image, workspace, toolkits) exists and is
    visible to the caller; else NotFound naming the field, the same as a missing one. Returns
    them, in image_refs order."""
    infos = []
    for field, name in image_refs(args):
        try:
            info = images.get(name, field)
        except NotFound:
            raise unusable(field, name, _usable(iam, who, images)) from None
        check_visible(iam, who, field, name, info, images)
        infos.append(info)
    return infos


async def check_usable_on(iam: IAM, edge: EdgeHandle, who: Principal, args: Any) -> None:
    """check_usable against the registry of the node that would create it (an apiserver
    without one of its own: cluster replicas): one call to the edge for all the refs."""
    refs = image_refs(args)
    for (field, name), info in zip(refs, await edge.resolve_images(refs)):
        check_visible(iam, who, field, name, info)
