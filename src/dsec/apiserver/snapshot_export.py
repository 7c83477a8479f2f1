"""A create from a container snapshot on a node other than the snapshot's: the snapshot's node
packs it as a workspace layer in the shared layer store (EdgeHandle.export_snapshot), and the
create becomes an ordinary one of the source's image with that workspace and the source's args,
placed like any create. Used when the snapshot's node takes no new sandbox (draining,
forgotten, full); control.py decides when."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from dsec.types import DsecError, NodeUnreachable, NotFound, SandboxArgs, SnapshotImage

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext, EdgeHandle

log = logging.getLogger("dsec.apiserver")

_OWN = ("image", "backend", "snapshot")      # what the export decides, not the request


def args_from(args: SandboxArgs, exp: SnapshotImage) -> SandboxArgs:
    """The request's args over the snapshot's source's, as a create on the snapshot's node
    merges them (ContainerDriver._from_snapshot): fields the request set win, env and labels
    are added to the source's."""
    was = dict(exp.args)
    given = args.model_dump(mode="json", include={f for f in args.model_fields_set if f not in _OWN})
    for f in ("env", "labels"):
        if f in given:
            given[f] = {**(was.get(f) or {}), **(given[f] or {})}
    return type(args).model_validate({**was, **given, "image": exp.image, "workspace": exp.workspace,
                                      "snapshot": None, "idempotency_key": getattr(args, "idempotency_key", None)})


async def delete_snapshot(ctx: ApiContext, edge: EdgeHandle, snapshot_id: str) -> None:
    """Delete a snapshot on its node, and its export with it: every node drops the export from
    its registry unless a sandbox or snapshot of its own was made from it, and once none is
    (every node answered) the snapshot's node deletes it from the shared layer store. Sandboxes
    made from it keep running either way: a node whose sandbox uses it keeps it, and layers a
    mount holds stay readable. An export still in use stays in the store (logged)."""
    await edge.delete_snapshot(snapshot_id)
    try:
        await _drop_export(ctx, edge, snapshot_id)
    except DsecError as e:      # the snapshot is deleted: its export stays (logged), the delete succeeds
        log.warning("snapshot export not dropped", extra={"snapshot": snapshot_id, "error": e.message})


async def _drop_export(ctx: ApiContext, edge: EdgeHandle, snapshot_id: str) -> None:
    try:
        mine = await edge.drop_export(snapshot_id)
    except NotFound:        # an edge of a release without the verb
        return
    if mine is None:        # never exported: the common case, one call
        return
    others = [e for _, e in sorted(ctx.edges.items()) if e is not edge]

    async def users(other: EdgeHandle) -> list[str] | None:
        try:
            return await other.drop_export(snapshot_id) or []
        except (NodeUnreachable, NotFound) as e:
            log.warning("snapshot export kept: a node did not say whether it uses it",
                        extra={"snapshot": snapshot_id, "error": e.message})
            return None
    found = [*await asyncio.gather(*(users(e) for e in others)), mine]
    held = sorted(u for us in found if us for u in us)
    if held or any(us is None for us in found):
        log.warning("snapshot export kept in the shared layer store", extra={"snapshot": snapshot_id,
                                                                            "used_by": held[:20]})
        return
    await edge.drop_export(snapshot_id, unpublish=True)
