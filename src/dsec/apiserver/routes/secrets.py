"""Egress secrets (issue 30): create, list, remove; no route returns a value."""

from __future__ import annotations

from fastapi import APIRouter

from dsec.apiserver import egress_secrets
from dsec.apiserver.audit import note_target
from dsec.apiserver.deps import Ctx, Who
from dsec.types import SecretCreate, SecretInfo, SecretList

router = APIRouter()


@router.post("/v1/secrets", status_code=201, response_model=SecretInfo)
async def create_secret(req: SecretCreate, who: Who, ctx: Ctx) -> SecretInfo:
    """Store a credential of the caller's project with the destinations it is added to (by the
    egress proxy, for sandboxes created with `secrets=[name]`). The value is never returned."""
    note_target(req.name)       # the audit log names it; the value stays out
    return egress_secrets.store(ctx).create(who.project_id, req)


@router.get("/v1/secrets", response_model=SecretList)
async def list_secrets(who: Who, ctx: Ctx) -> SecretList:
    return SecretList(items=egress_secrets.store(ctx).list(who.project_id))


@router.delete("/v1/secrets/{name}", response_model=SecretInfo)
async def delete_secret(name: str, who: Who, ctx: Ctx) -> SecretInfo:
    """Remove it; every node stops adding it before this returns (next connections)."""
    st = egress_secrets.store(ctx)
    info = st.get(who.project_id, name)
    await egress_secrets.revoke(ctx, st.delete(who.project_id, name))
    return info
