"""A create from a container snapshot on a node other than the snapshot's: the snapshot's node
packs it as a workspace layer in the shared layer store (EdgeHandle.export_snapshot), and the
create becomes an ordinary one of the source's image with that workspace and the source's args,
placed like any create. Used when the snapshot's node takes no new sandbox (draining,
forgotten, full); control.py decides when."""

from __future__ import annotations

from dsec.types import SandboxArgs, SnapshotImage

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
