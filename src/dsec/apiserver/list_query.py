"""Filters and pages of GET /v1/sandboxes: by project, labels and state, newest first, at
most `limit` per answer from `offset` (the dashboard's sandbox table shows one page of
thousands: apiserver/ui/).

The nodes are still asked for all their sandboxes (listing.py); what is cut here is the
answer, which is what costs at 3,200 sandboxes (JSON, the wire, the browser). Offsets over a
list that changes between pages may skip or repeat a row; a table refreshed every few
seconds shows that at once, which a cursor would not make worth its state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dsec.iam import IAM, Principal
from dsec.types import InvalidArgument, NotFound, SandboxInfo, SandboxList, SandboxState
from dsec.types.sandboxes import LABEL_KEY_RE

ENDED = frozenset({SandboxState.stopped, SandboxState.failed})
MAX_LIMIT = 1000
_KEY = re.compile(LABEL_KEY_RE)


@dataclass(frozen=True)
class SandboxQuery:
    project: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    states: frozenset[SandboxState] = frozenset()
    limit: int | None = None
    offset: int = 0

    @property
    def filtered(self) -> bool:
        return bool(self.project or self.labels or self.states or self.limit is not None or self.offset)

    @property
    def wants_ended(self) -> bool:
        """A state filter that names an ended state lists ended sandboxes without include_ended."""
        return bool(self.states & ENDED)


def parse_labels(raw: list[str]) -> dict[str, str]:
    """`key=value` pairs (the `label` query parameter, repeated): all must match."""
    out: dict[str, str] = {}
    for item in raw:
        key, eq, value = item.partition("=")
        if not eq or not _KEY.match(key):
            raise InvalidArgument(f"label: {item[:80]!r} is not key=value", field="label",
                                  fix="send label=KEY=VALUE (key: 1-63 chars [A-Za-z0-9._/-]); "
                                      "repeat it to require several labels")
        out[key] = value
    return out


def check_project(iam: IAM, who: Principal, project: str | None) -> None:
    """A project filter names a project the caller may see (others' look missing, as elsewhere)."""
    if project is not None and not iam.can_access(who, project):
        raise NotFound(f"no project {project!r}", field="project",
                       fix="use the id of your project or one below it (GET /v1/projects)")


def matches(s: SandboxInfo, q: SandboxQuery) -> bool:
    return ((q.project is None or s.project == q.project)
            and (not q.states or s.state in q.states)
            and all(s.labels.get(k) == v for k, v in q.labels.items()))


def select(listing: SandboxList, q: SandboxQuery) -> SandboxList:
    """The listing cut to the query: matching sandboxes, newest first, one page of them."""
    if not q.filtered:
        return listing       # the plain listing, unchanged (SDK list())
    rows = sorted((s for s in listing.sandboxes if matches(s, q)), key=lambda s: (s.created_at, s.id), reverse=True)
    end = len(rows) if q.limit is None else q.offset + q.limit
    return SandboxList(sandboxes=rows[q.offset:end], unreachable_nodes=listing.unreachable_nodes,
                       total=len(rows), next_offset=end if end < len(rows) else None)
