"""E2B's snapshot names on dsec snapshots.

A name ('name' or 'name:tag', tag 'default' when left out) belongs to the project of the key
that gave it, and is held by the newest snapshot of that project taken under it: naming a new
snapshot like an older one moves the name (E2B: "a new build assigned to the existing
template"); the older snapshot keeps its id. A create whose template is the name (bare,
tag-qualified or `<project>/name[:tag]`) starts from the holder. An image the caller can see
wins over a snapshot name, and a snapshot cannot be named like one.
"""

from __future__ import annotations

import re

from dsec.apiserver.context import ApiContext
from dsec.apiserver.e2b.mapping import TEMPLATE_ALIASES
from dsec.apiserver.tenancy import visible
from dsec.iam import Principal
from dsec.types import InvalidArgument, SnapshotInfo

DEFAULT_TAG = "default"
_PART = r"[a-z0-9][a-z0-9._-]{0,62}"
NAME_RE = re.compile(rf"^(?:(?P<ns>{_PART})/)?(?P<name>{_PART})(?::(?P<tag>{_PART}))?$")


def parse(ref: str) -> tuple[str | None, str] | None:
    """(namespace or None, 'name:tag') of a reference, None when it is not a name's form."""
    m = NAME_RE.match(ref)
    if m is None:
        return None
    return m["ns"], f"{m['name']}:{m['tag'] or DEFAULT_TAG}"


def checked(name: str, who: Principal) -> str:
    """The 'name:tag' a create_snapshot(name=...) stores; 400 naming `name` when malformed."""
    got = parse(name)
    if got is None or (got[0] is not None and got[0] != who.project_name):
        raise InvalidArgument(f"name {name[:80]!r} is not a snapshot name", field="name",
                              fix="use lowercase letters, digits, '.', '_' and '-' (up to 63), optionally "
                                  f"':tag' and a '{who.project_name}/' prefix")
    return got[1]


def holders(snaps: list[SnapshotInfo]) -> dict[tuple[str, str], str]:
    """(project, 'name:tag') -> id of the newest snapshot taken under that name."""
    out: dict[tuple[str, str], SnapshotInfo] = {}
    for s in snaps:
        if s.name is None:
            continue
        key = (s.project, s.name)
        if key not in out or (s.created_at, s.id) > (out[key].created_at, out[key].id):
            out[key] = s
    return {k: v.id for k, v in out.items()}


def names_of(s: SnapshotInfo, held: dict[tuple[str, str], str], project_name: str) -> list[str]:
    """E2B's `names` of a listed snapshot: its full name while it holds it, else none."""
    if s.name is not None and held.get((s.project, s.name)) == s.id:
        return [f"{project_name}/{s.name}"]
    return []


def matches(s: SnapshotInfo, ref: str, held: dict[tuple[str, str], str], who: Principal) -> bool:
    """list_snapshots(name=...): an id (tag ignored) or a name the snapshot holds."""
    if s.id == ref.split(":")[0]:
        return True
    got = parse(ref)
    return (got is not None and got[0] in (None, who.project_name) and s.name == got[1]
            and held.get((s.project, s.name)) == s.id)


async def all_of(ctx: ApiContext, who: Principal) -> list[SnapshotInfo]:
    """The snapshots the caller may use, on every node."""
    out: list[SnapshotInfo] = []
    for edge in ctx.edges.values():
        out += [s for s in await edge.list_snapshots() if ctx.iam.can_access(who, s.project)]
    return out


def is_image(ctx: ApiContext, who: Principal, ref: str) -> bool:
    """Whether `ref` is a template (an E2B alias or an image the caller can see)."""
    if ref in TEMPLATE_ALIASES:
        return True
    info = ctx.images.registry.get_image(ref) if ctx.images is not None else None
    return info is not None and visible(ctx.iam, who, info)


async def resolve(ctx: ApiContext, who: Principal, template_id: str) -> str | None:
    """The snapshot id a create's template names, when it is a snapshot name of the caller's
    project (not an image it can see); None otherwise (the template is an image)."""
    got = parse(template_id)
    if got is None or got[0] not in (None, who.project_name) or is_image(ctx, who, template_id):
        return None
    own = [s for s in await all_of(ctx, who) if s.project == who.project_id and s.name == got[1]]
    return holders(own).get((who.project_id, got[1]))
