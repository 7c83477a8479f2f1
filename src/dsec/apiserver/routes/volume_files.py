"""The files of a volume of the caller's project, without a sandbox (volumes/files.py: no link
is followed, `..` is refused, the volume's byte quota holds). Read and write whole files of up
to 64 MiB; list, stat, make directories, remove."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from dsec.apiserver.deps import Ctx, Who, read_body
from dsec.apiserver.guard import MAX_FILE_BYTES
from dsec.apiserver.routes.volumes import volume_edge
from dsec.types import VolumeEntry, VolumeEntryList

router = APIRouter()

VolPath = Annotated[str, Query(max_length=4096, description="from the volume's root, e.g. '/dir/file'")]
Id = Annotated[int | None, Query(ge=0, le=65535, description="as sandboxes see it; default 1000 (the default user)")]
Mode = Annotated[int | None, Query(ge=0, le=0o7777, description="permission bits; default 0644 (dirs 0755)")]


TOO_LARGE_FIX = "split the file, or write it through a sandbox that mounts the volume"


@router.get("/v1/volumes/{name}/file", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}}}})
async def read_volume_file(name: str, path: VolPath, who: Who, ctx: Ctx) -> Response:
    data = await volume_edge(ctx).volume_read(who.project_id, name, path, MAX_FILE_BYTES)
    return Response(data, media_type="application/octet-stream")


@router.put("/v1/volumes/{name}/file", response_model=VolumeEntry)
async def write_volume_file(name: str, path: VolPath, request: Request, who: Who, ctx: Ctx, uid: Id = None,
                            gid: Id = None, mode: Mode = None, mkdirs: bool = True) -> VolumeEntry:
    data = await read_body(request, TOO_LARGE_FIX)
    return await volume_edge(ctx).volume_write(who.project_id, name, path, data, uid, gid, mode, mkdirs)


@router.delete("/v1/volumes/{name}/file", status_code=204)
async def remove_volume_path(name: str, path: VolPath, who: Who, ctx: Ctx) -> Response:
    """A file, a link, or a directory with all it holds."""
    await volume_edge(ctx).volume_remove(who.project_id, name, path)
    return Response(status_code=204)


@router.get("/v1/volumes/{name}/stat", response_model=VolumeEntry)
async def stat_volume_path(name: str, path: VolPath, who: Who, ctx: Ctx) -> VolumeEntry:
    return await volume_edge(ctx).volume_stat(who.project_id, name, path)


@router.get("/v1/volumes/{name}/dir", response_model=VolumeEntryList)
async def list_volume_dir(name: str, who: Who, ctx: Ctx, path: VolPath = "/",
                          depth: Annotated[int, Query(ge=1, le=16)] = 1) -> VolumeEntryList:
    return VolumeEntryList(entries=await volume_edge(ctx).volume_entries(who.project_id, name, path, depth))


@router.post("/v1/volumes/{name}/dir", response_model=VolumeEntry, status_code=201)
async def make_volume_dir(name: str, path: VolPath, who: Who, ctx: Ctx, uid: Id = None, gid: Id = None,
                          mode: Mode = None, parents: bool = False) -> VolumeEntry:
    return await volume_edge(ctx).volume_mkdir(who.project_id, name, path, uid, gid, mode, parents)
