"""Snapshots (VMs: memory and disk; containers: the filesystem): take, list, get, delete (a snapshot
lives on the node of its sandbox)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from dsec.apiserver import control, snapshot_export
from dsec.apiserver.deps import Ctx, Who, owned
from dsec.types import SnapshotInfo, SnapshotList

router = APIRouter()


@router.post("/v1/sandboxes/{sandbox_id}/snapshot", status_code=201, response_model=SnapshotInfo)
async def snapshot(sandbox_id: str, who: Who, ctx: Ctx) -> SnapshotInfo:
    """Save a running sandbox (a VM's memory, devices and disk; a container's filesystem, as a
    read-only copy-on-write snapshot); start new sandboxes of it with
    `{"backend": ..., "image": ..., "snapshot": id}`. It pauses briefly and runs on."""
    edge = await owned(ctx, sandbox_id, who)
    return await edge.snapshot(sandbox_id)


@router.get("/v1/snapshots", response_model=SnapshotList)
async def list_snapshots(who: Who, ctx: Ctx) -> SnapshotList:
    """Snapshots of the caller's project and its sub-projects, on every node."""
    out: list[SnapshotInfo] = []
    for edge in ctx.edges.values():
        out += [s for s in await edge.list_snapshots() if ctx.iam.can_access(who, s.project)]
    return SnapshotList(snapshots=out)


@router.get("/v1/snapshots/{snapshot_id}", response_model=SnapshotInfo)
async def get_snapshot(snapshot_id: str, who: Who, ctx: Ctx) -> SnapshotInfo:
    edge = await control.owned_snapshot(ctx, snapshot_id, who)
    return await edge.get_snapshot(snapshot_id)


@router.delete("/v1/snapshots/{snapshot_id}", status_code=204)
async def delete_snapshot(snapshot_id: str, who: Who, ctx: Ctx) -> Response:
    """Free a snapshot's disk. Sandboxes restored from it, and snapshots of those, are not
    affected (they keep their own links to the disk it shares with them)."""
    edge = await control.owned_snapshot(ctx, snapshot_id, who)
    await snapshot_export.delete_snapshot(ctx, edge, snapshot_id)
    return Response(status_code=204)
