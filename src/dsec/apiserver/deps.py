"""What every route of dsec's own API shares: who is calling, the apiserver's context, the
common parameter types, and the sandbox/snapshot lookups that hide other projects' ids.

One definition each: a router declares `who: Who, ctx: Ctx` and gets both (the guard
authenticated the key from the headers before the body was read; apiserver/guard.py).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi import Path as PathParam

from dsec.apiserver import control
from dsec.apiserver.context import ApiContext, EdgeHandle
from dsec.apiserver.guard import MAX_FILE_BYTES, principal_of, request_key
from dsec.iam import Principal
from dsec.types import Forbidden, InvalidArgument


async def read_body(request: Request, fix: str) -> bytes:
    """A file's request body of at most MAX_FILE_BYTES (the guard bounds it too); `fix` says
    how a larger file gets there instead."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FILE_BYTES:
            raise InvalidArgument(f"file larger than {MAX_FILE_BYTES} bytes", field="body", fix=fix)
    return bytes(body)


def context(request: Request) -> ApiContext:
    return request.app.state.ctx


def caller(request: Request) -> Principal:
    """Who the guard authenticated (`Authorization: Bearer <key>`), or the key authenticated now."""
    return principal_of(request) or context(request).iam.authenticate(request_key(request))


async def _context_dep(request: Request) -> ApiContext:
    return context(request)


async def _caller_dep(request: Request) -> Principal:
    return caller(request)


# FastAPI resolves these (string) annotations in the routers' module globals: import them by name.
# The dependencies are coroutines: FastAPI runs a plain `def` dependency in its thread pool, two
# thread hand-offs per request for a dict lookup (issue 29; the guard already authenticated the
# key on the loop, so caller() blocks no more than the guard did).
Ctx = Annotated[ApiContext, Depends(_context_dep)]
Who = Annotated[Principal, Depends(_caller_dep)]
Path_ = Annotated[str, Query(min_length=1, max_length=4096, description="path inside the sandbox")]
ExecId = Annotated[str, PathParam(pattern=r"^[0-9]{1,10}$", description="the exec_id from run/stream")]


def is_admin(ctx: ApiContext, who: Principal) -> bool:
    """A key of the root project."""
    return who.project_id == ctx.iam.root().id


def admin_only(ctx: ApiContext, who: Principal, what: str, field: str, fix: str = "leave it off, or ask an admin") -> None:
    if not is_admin(ctx, who):
        raise Forbidden(f"only an admin (a key of the root project) may {what}", field=field, fix=fix)


async def owned(ctx: ApiContext, sandbox_id: str, who: Principal) -> EdgeHandle:
    """The edge of a sandbox the caller's project (or an ancestor) owns; others' look missing."""
    return await control.owned_edge(ctx, sandbox_id, who)
