"""Identifiers: a sandbox id encodes the node that owns it, so any apiserver can forward."""

from __future__ import annotations

import re
import secrets

from dsec.types.errors import InvalidArgument, NotFound


NODE_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")
SANDBOX_ID_RE = re.compile(r"^sb-(?P<node>[a-z0-9][a-z0-9-]{0,30})\.(?P<rand>[0-9a-f]{12})$")


def make_sandbox_id(node_id: str) -> str:
    if not NODE_ID_RE.match(node_id):
        raise InvalidArgument(f"bad node id {node_id!r}", field="node_id",
                              fix="use lowercase letters, digits and '-', at most 31 chars")
    return f"sb-{node_id}.{secrets.token_hex(6)}"


SNAPSHOT_ID_PATTERN = r"^snap-[a-z0-9][a-z0-9-]{0,30}\.[0-9a-f]{12}$"


def make_snapshot_id(node: str) -> str:
    return f"snap-{node}.{secrets.token_hex(6)}"


def node_of_snapshot(snapshot_id: str) -> str:
    if not re.match(SNAPSHOT_ID_PATTERN, snapshot_id):
        raise NotFound(f"no snapshot {snapshot_id!r}: not a snapshot id", field="snapshot",
                       fix="use an id returned by Sandbox.snapshot(), e.g. 'snap-node0.0123456789ab'")
    return snapshot_id.removeprefix("snap-").rsplit(".", 1)[0]


def node_of(sandbox_id: str) -> str:
    m = SANDBOX_ID_RE.match(sandbox_id)
    if not m:
        raise NotFound(f"no sandbox {sandbox_id!r}: not a sandbox id", field="sandbox_id",
                       fix="use an id returned by create, e.g. 'sb-node0.0123456789ab'")
    return m.group("node")
