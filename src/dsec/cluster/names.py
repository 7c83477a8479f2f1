"""Node names: a cluster node's identity, independent of Ray's ids (D55).

A Ray node id changes whenever its raylet starts again (a crash, a host reboot); a dsec node's
name must not, since sandbox ids carry it (`sb-<node>.<rand>`) and its DSEC_HOME, subnet and
sandboxes belong to it. So a raylet advertises its node's name as a Ray custom resource,
`dsec_node:<name>` = 1, and the node's edge actor needs that resource instead of being pinned
to a Ray node id: Ray restarts it on whichever raylet offers the name, which then adopts the
sandboxes in <node-homes>/<name>.

    ray start --address <head>:6379 --resources "$(dsec cluster node-resources)"

The name is `--node-name`, else the one kept in <node-homes>/node.name on the host (made from
the host name on first use), so the same command on the same host gives the same name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

from dsec.types import NODE_ID_RE, InvalidArgument

RESOURCE_PREFIX = "dsec_node:"
# what of a raylet's one unit of its name's resource each actor needs: its edge, and a replica
# pinned there (`cluster up --api-nodes`) beside it
EDGE_SHARE = 0.5
REPLICA_SHARE = 0.25
NAME_FILE = "node.name"


def check_name(name: str, field: str = "node_name") -> str:
    if not NODE_ID_RE.match(name):
        raise InvalidArgument(f"node name {name!r} is not valid", field=field,
                              fix="use lowercase letters, digits and '-' (at most 31, starting with a letter or digit)")
    return name


def from_hostname(hostname: str) -> str:
    """A valid node name from a host name (its first label, lowercased, other characters '-')."""
    base = re.sub(r"[^a-z0-9-]", "-", hostname.split(".")[0].lower()).strip("-")[:31]
    return base or "node"


def host_node_name(node_homes: Path, given: str | None = None) -> str:
    """The name of this host's node: `given` (checked), else the one kept in
    <node_homes>/node.name, made from the host name and kept there on first use."""
    if given:
        return check_name(given)
    f = node_homes / NAME_FILE
    if f.exists():
        return check_name(f.read_text().strip(), field=str(f))
    name = from_hostname(socket.gethostname())
    node_homes.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(f".{os.getpid()}")
    tmp.write_text(name + "\n")
    os.replace(tmp, f)
    return name


def resources(name: str) -> str:
    """`ray start --resources` for a raylet of this node."""
    return json.dumps({RESOURCE_PREFIX + check_name(name): 1})


def name_of(ray_node: dict[str, Any]) -> str | None:
    """The dsec node name a Ray node (an entry of ray.nodes()) advertises; None: none (or not
    a valid one)."""
    for r in ray_node.get("Resources", {}):
        if r.startswith(RESOURCE_PREFIX) and NODE_ID_RE.match(r.removeprefix(RESOURCE_PREFIX)):
            return r.removeprefix(RESOURCE_PREFIX)
    return None


def link_tag(name: str, room: int) -> str:
    """The name in at most `room` characters, for interface names (15 at most in all): the name
    itself if it fits, else a hash of it (two long names sharing a prefix must not collide)."""
    return name if len(name) <= room else hashlib.sha256(name.encode()).hexdigest()[:room]


def bridge_name(name: str) -> str:
    """The node's sandbox bridge (DSEC_NET_BRIDGE): unique per node name among the edges of a host."""
    return "dc" + link_tag(name, 13)
