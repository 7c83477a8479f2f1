"""Files inside a sandbox: read, write, list, remove, watch."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from dsec.apiserver.deps import Ctx, Path_, Who, owned
from dsec.apiserver.guard import MAX_FILE_BYTES
from dsec.types import DsecError, FileList, InvalidArgument

router = APIRouter()


@router.get("/v1/sandboxes/{sandbox_id}/files", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}}}})
async def read_file(sandbox_id: str, path: Path_, who: Who, ctx: Ctx) -> Response:
    edge = await owned(ctx, sandbox_id, who)
    return Response(await edge.read_file(sandbox_id, path, MAX_FILE_BYTES), media_type="application/octet-stream")


@router.put("/v1/sandboxes/{sandbox_id}/files", status_code=204)
async def write_file(sandbox_id: str, path: Path_, request: Request, who: Who, ctx: Ctx,
                     mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644, mkdirs: bool = True) -> Response:
    edge = await owned(ctx, sandbox_id, who)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FILE_BYTES:
            raise InvalidArgument(f"file larger than {MAX_FILE_BYTES} bytes", field="body",
                                  fix="split the file, or write it from inside the sandbox")
    await edge.write_file(sandbox_id, path, bytes(body), mode, mkdirs)
    return Response(status_code=204)


@router.get("/v1/sandboxes/{sandbox_id}/files/list", response_model=FileList)
async def list_files(sandbox_id: str, path: Path_, who: Who, ctx: Ctx) -> FileList:
    edge = await owned(ctx, sandbox_id, who)
    return FileList(path=path, entries=await edge.list_dir(sandbox_id, path))


@router.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
async def remove_file(sandbox_id: str, path: Path_, who: Who, ctx: Ctx) -> Response:
    edge = await owned(ctx, sandbox_id, who)
    await edge.remove_file(sandbox_id, path)
    return Response(status_code=204)


WATCH_NDJSON = {200: {"content": {"application/x-ndjson": {}},
                      "description": "one FsEvent JSON object per line; an error ends it with a line "
                                     "{\"error\": {code, message, field, fix}}"}}


@router.get("/v1/sandboxes/{sandbox_id}/files/watch", responses=WATCH_NDJSON)
async def watch_files(sandbox_id: str, path: Path_, who: Who, ctx: Ctx, recursive: bool = False) -> StreamingResponse:
    """Changes below directory `path` as they happen (its whole tree with recursive=true), as
    the sandbox's user: `start` once the watch is in place, then create, write, remove,
    rename, chmod (name relative to `path`), `overflow` when events were lost; until the
    client goes away. The sandbox counts as busy meanwhile."""
    edge = await owned(ctx, sandbox_id, who)
    events = edge.watch_dir(sandbox_id, path, recursive)
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
