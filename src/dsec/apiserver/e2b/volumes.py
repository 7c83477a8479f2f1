"""E2B's volume API (the SDK's Volume / AsyncVolume) on dsec's volumes (routes/volumes.py):

    POST   /volumes              {name} -> 201 {volumeID, name, token}
    GET    /volumes              [{volumeID, name}] of the caller's project
    GET    /volumes/{volumeID}   {volumeID, name, token}
    DELETE /volumes/{volumeID}   204; 404 unknown; 409 while a sandbox mounts it

Sandbox.create(volume_mounts={path: volume}) mounts them (mapping.py). The volume content API
(/volumecontent/..., the Volume's file methods) is volume_content.py; `token` is that API's:
it opens the one volume.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from dsec.apiserver.context import ApiContext
from dsec.apiserver.e2b.auth import AccessTokens
from dsec.apiserver.e2b.volume_content import add_volume_content_routes
from dsec.apiserver.guard import principal_of
from dsec.apiserver.routes.volumes import delete_volume_everywhere, volume_edge
from dsec.iam import Principal
from dsec.types import InvalidArgument, NotFound, Unauthorized, VolumeCreate, VolumeInfo


def who_of(request: Request) -> Principal:
    p = principal_of(request)
    if p is None:    # the guard authenticates every E2B REST request; this is a safety net
        raise Unauthorized("no API key", field="X-API-KEY", fix="set E2B_API_KEY to a dsec API key")
    return p


def add_volume_routes(app: FastAPI, ctx: ApiContext, tokens: AccessTokens) -> None:
    def _out(v: VolumeInfo, token: bool = True) -> dict[str, Any]:
        return {"volumeID": v.id, "name": v.name, **({"token": tokens.volume_token(v.id)} if token else {})}

    add_volume_content_routes(app, ctx, tokens)

    async def find(request: Request, volume_id: str) -> VolumeInfo:
        who = who_of(request)
        for v in await volume_edge(ctx).list_volumes(who.project_id):
            if v.id == volume_id:
                return v
        raise NotFound(f"volume {volume_id} not found", field="volumeID",
                       fix="use an id from Volume.list() (volumes of your own project)")

    @app.post("/volumes")
    async def create(request: Request, body: Annotated[dict[str, Any], Body()]) -> JSONResponse:
        try:
            req = VolumeCreate(name=body.get("name", ""))
        except ValidationError:
            raise InvalidArgument(f"volume name {str(body.get('name'))[:80]!r} is not one dsec takes", field="name",
                                  fix="use 1-63 of a-z 0-9 _ . - starting with a letter or digit") from None
        v = await volume_edge(ctx).create_volume(who_of(request).project_id, req)
        return JSONResponse(_out(v), status_code=201)

    @app.get("/volumes")
    async def list_(request: Request) -> list[dict[str, Any]]:
        return [_out(v, token=False) for v in await volume_edge(ctx).list_volumes(who_of(request).project_id)]

    @app.get("/volumes/{volume_id}")
    async def get(request: Request, volume_id: str) -> dict[str, Any]:
        return _out(await find(request, volume_id))

    @app.delete("/volumes/{volume_id}")
    async def delete(request: Request, volume_id: str) -> Response:
        v = await find(request, volume_id)
        await delete_volume_everywhere(ctx, v.project, v.name)
        return Response(status_code=204)
