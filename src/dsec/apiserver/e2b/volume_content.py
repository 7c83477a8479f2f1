"""E2B's volume content API (the SDK's Volume file methods) on dsec's volume files
(volumes/files.py through the edge's volume_* verbs):

    GET    /volumecontent/{volumeID}/file?path=        the file's bytes
    PUT    /volumecontent/{volumeID}/file?path=&uid&gid&mode   201 the entry (parents made)
    GET    /volumecontent/{volumeID}/dir?path=&depth=  the entries below
    POST   /volumecontent/{volumeID}/dir?path=&uid&gid&mode&force   201 the new directory
    GET    /volumecontent/{volumeID}/path?path=        the entry
    PATCH  /volumecontent/{volumeID}/path?path=  {uid, gid, mode}
    DELETE /volumecontent/{volumeID}/path?path=        204

Authenticated, as E2B does, by the volume's token (`Authorization: Bearer <token>`, from
Volume.create / Volume.connect): an HMAC of the volume id under the server's E2B secret
(auth.py), so it opens that one volume; the guard lets these paths through to this check.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from dsec.apiserver.context import ApiContext
from dsec.apiserver.deps import read_body
from dsec.apiserver.e2b.auth import AccessTokens
from dsec.apiserver.guard import MAX_FILE_BYTES
from dsec.apiserver.routes.volume_files import TOO_LARGE_FIX
from dsec.apiserver.routes.volumes import volume_edge
from dsec.types import InvalidArgument, NotFound, Unauthorized, VolumeEntry, VolumeInfo

VolPath = Annotated[str, Query(max_length=4096)]
Id = Annotated[int | None, Query(ge=0, le=65535)]
Mode = Annotated[int | None, Query(ge=0, le=0o7777)]


def _entry(e: VolumeEntry) -> dict[str, Any]:
    return e.model_dump(mode="json", exclude_none=True)


def add_volume_content_routes(app: FastAPI, ctx: ApiContext, tokens: AccessTokens) -> None:
    async def volume(request: Request, volume_id: str) -> VolumeInfo:
        """The volume the request's token opens; 401 for a missing or wrong token, 404 for an
        unknown id (the token is checked first: ids are not probed without one)."""
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if not tokens.check_volume(volume_id, token):
            raise Unauthorized(f"no valid token for volume {volume_id[:40]}", field="token",
                               fix="use the token Volume.create / Volume.connect returned "
                                   "(Volume.connect(volume_id) with your API key gets it)")
        for v in await volume_edge(ctx).list_volumes(None):
            if v.id == volume_id:
                return v
        raise NotFound(f"volume {volume_id} not found", field="volumeID", fix="it was destroyed; list with Volume.list()")

    @app.get("/volumecontent/{volume_id}/file")
    async def read_file(request: Request, volume_id: str, path: VolPath) -> Response:
        v = await volume(request, volume_id)
        data = await volume_edge(ctx).volume_read(v.project, v.name, path, MAX_FILE_BYTES)
        return Response(data, media_type="application/octet-stream")

    @app.put("/volumecontent/{volume_id}/file")
    async def write_file(request: Request, volume_id: str, path: VolPath, uid: Id = None, gid: Id = None,
                         mode: Mode = None, force: bool | None = None) -> JSONResponse:
        v = await volume(request, volume_id)
        data = await read_body(request, TOO_LARGE_FIX)
        e = await volume_edge(ctx).volume_write(v.project, v.name, path, data, uid, gid, mode, True)
        return JSONResponse(_entry(e), status_code=201)

    @app.get("/volumecontent/{volume_id}/dir")
    async def list_dir(request: Request, volume_id: str, path: VolPath = "/",
                       depth: Annotated[int | None, Query(ge=1, le=16)] = None) -> list[dict[str, Any]]:
        v = await volume(request, volume_id)
        return [_entry(e) for e in await volume_edge(ctx).volume_entries(v.project, v.name, path, depth or 1)]

    @app.post("/volumecontent/{volume_id}/dir")
    async def make_dir(request: Request, volume_id: str, path: VolPath, uid: Id = None, gid: Id = None,
                       mode: Mode = None, force: bool | None = None) -> JSONResponse:
        v = await volume(request, volume_id)
        e = await volume_edge(ctx).volume_mkdir(v.project, v.name, path, uid, gid, mode, bool(force))
        return JSONResponse(_entry(e), status_code=201)

    @app.get("/volumecontent/{volume_id}/path")
    async def stat(request: Request, volume_id: str, path: VolPath) -> dict[str, Any]:
        v = await volume(request, volume_id)
        return _entry(await volume_edge(ctx).volume_stat(v.project, v.name, path))

    @app.patch("/volumecontent/{volume_id}/path")
    async def update(request: Request, volume_id: str, path: VolPath,
                     body: Annotated[dict[str, Any] | None, Body()] = None) -> dict[str, Any]:
        v = await volume(request, volume_id)
        body = body or {}
        vals: dict[str, int | None] = {}
        for k in ("uid", "gid", "mode"):
            x = body.get(k)
            if x is not None and (not isinstance(x, int) or isinstance(x, bool)):
                raise InvalidArgument(f"{k} must be an integer", field=k, fix=f"pass {k} as a number")
            vals[k] = x
        return _entry(await volume_edge(ctx).volume_update(v.project, v.name, path, **vals))

    @app.delete("/volumecontent/{volume_id}/path", status_code=204)
    async def remove(request: Request, volume_id: str, path: VolPath) -> Response:
        v = await volume(request, volume_id)
        await volume_edge(ctx).volume_remove(v.project, v.name, path)
        return Response(status_code=204)
