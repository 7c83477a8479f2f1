"""Files inside a sandbox: read, write, list, remove, watch."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from dsec.apiserver import control
from dsec.apiserver.context import ApiContext, EdgeHandle
from dsec.apiserver.deps import Ctx, Path_, Who, owned, read_body
from dsec.apiserver.guard import MAX_FILE_BYTES
from dsec.iam import Principal
from dsec.types import USER_RE, DsecError, FileList

router = APIRouter()

User = Annotated[str | None, Query(pattern=USER_RE, description="act as this user: 'root', 'sandbox' or 'UID[:GID]' "
                                                                  "(permission checks and owner of created files); "
                                                                  "unset: the sandbox's user")]


async def _edge(ctx: ApiContext, sandbox_id: str, who: Principal, user: str | None) -> EdgeHandle:
    """The sandbox's edge, once a root file call is known to be allowed (allow_root)."""
    edge = await owned(ctx, sandbox_id, who)
    await control.check_file_user(ctx, edge, sandbox_id, user)
    return edge


@router.get("/v1/sandboxes/{sandbox_id}/files", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}}}})
async def read_file(sandbox_id: str, path: Path_, who: Who, ctx: Ctx, user: User = None) -> Response:
    edge = await _edge(ctx, sandbox_id, who, user)
    return Response(await edge.read_file(sandbox_id, path, MAX_FILE_BYTES, user=user),
                    media_type="application/octet-stream")


@router.put("/v1/sandboxes/{sandbox_id}/files", status_code=204)
async def write_file(sandbox_id: str, path: Path_, request: Request, who: Who, ctx: Ctx,
                     mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644, mkdirs: bool = True,
                     user: User = None) -> Response:
    edge = await _edge(ctx, sandbox_id, who, user)
    body = await read_body(request, fix="split the file, or write it from inside the sandbox")
    await edge.write_file(sandbox_id, path, body, mode, mkdirs, user=user)
    return Response(status_code=204)


@router.get("/v1/sandboxes/{sandbox_id}/files/list", response_model=FileList)
async def list_files(sandbox_id: str, path: Path_, who: Who, ctx: Ctx, user: User = None) -> FileList:
    edge = await _edge(ctx, sandbox_id, who, user)
    return FileList(path=path, entries=await edge.list_dir(sandbox_id, path, user=user))


@router.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
async def remove_file(sandbox_id: str, path: Path_, who: Who, ctx: Ctx, user: User = None) -> Response:
    edge = await _edge(ctx, sandbox_id, who, user)
    await edge.remove_file(sandbox_id, path, user=user)
    return Response(status_code=204)


WATCH_NDJSON = {200: {"content": {"application/x-ndjson": {}},
                      "description": "one FsEvent JSON object per line; an error ends it with a line "
                                     "{\"error\": {code, message, field, fix}}"}}


@router.get("/v1/sandboxes/{sandbox_id}/files/watch", responses=WATCH_NDJSON)
async def watch_files(sandbox_id: str, path: Path_, who: Who, ctx: Ctx, recursive: bool = False,
                      user: User = None) -> StreamingResponse:
    """Changes below directory `path` as they happen (its whole tree with recursive=true), as
    the sandbox's user (or `user`): `start` once the watch is in place, then create, write, remove,
    rename, chmod (name relative to `path`), `overflow` when events were lost; until the
    client goes away. The sandbox counts as busy meanwhile."""
    edge = await _edge(ctx, sandbox_id, who, user)
    events = edge.watch_dir(sandbox_id, path, recursive, user)
    first = await anext(events)   # refusals (missing, not allowed, too many) are HTTP errors

    async def lines() -> AsyncIterator[bytes]:
        yield first.model_dump_json().encode() + b"\n"
        try:
            async for ev in events:
                yield ev.model_dump_json().encode() + b"\n"
        except DsecError as e:
            yield json.dumps(e.to_body()).encode() + b"\n"
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:    # does not suspend: a client gone away frees the watch
                await aclose()

    return StreamingResponse(lines(), media_type="application/x-ndjson")
