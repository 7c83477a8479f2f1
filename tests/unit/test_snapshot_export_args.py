"""A container snapshot created on another node (apiserver/snapshot_export.py): the request's
fields over the snapshot's source's args, as a create on the snapshot's own node merges them."""

from __future__ import annotations

from dsec.apiserver.snapshot_export import args_from
from dsec.types import ContainerArgs, SnapshotImage


def test_the_request_wins_env_and_labels_add_and_the_export_decides_the_image():
    src = ContainerArgs(image="busybox", env={"A": "1", "B": "1"}, labels={"job": "x"}, workdir="/srv",
                        memory_mb=128, workspace="ws@1", idempotency_key="k-src")
    exp = SnapshotImage(snapshot="snap-n1.0123456789ab", image="busybox", workspace="snap-n1.0123456789ab@export",
                        args=src.model_dump(mode="json"))
    req = ContainerArgs(image="ignored", snapshot=exp.snapshot, env={"B": "2"}, memory_mb=256, idempotency_key="k-new")
    out = args_from(req, exp)
    assert isinstance(out, ContainerArgs)
    assert out.snapshot is None and out.image == "busybox" and out.workspace == exp.workspace
    assert out.env == {"A": "1", "B": "2"} and out.labels == {"job": "x"}
    assert out.workdir == "/srv" and out.memory_mb == 256
    assert out.idempotency_key == "k-new"       # the caller's, never the source's
