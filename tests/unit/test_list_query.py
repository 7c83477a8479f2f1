"""GET /v1/sandboxes' filters and pages (apiserver/list_query.py), on listings built here."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from dsec.apiserver.list_query import SandboxQuery, parse_labels, select
from dsec.types import InvalidArgument, SandboxInfo, SandboxList, SandboxState

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def info(i: int, project: str = "p1", state: SandboxState = SandboxState.running, **labels: str) -> SandboxInfo:
    return SandboxInfo(id=f"sb-n.{i:04d}", node="n", project=project, backend="container", state=state,
                       image="busybox", cpu_cores=1, memory_mb=64, ttl_idle_s=60, created_at=T0 + timedelta(seconds=i),
                       last_active_at=T0, labels=labels)


def test_no_filter_is_the_plain_listing_unchanged():
    listing = SandboxList(sandboxes=[info(1), info(2)], unreachable_nodes=["x"])
    assert select(listing, SandboxQuery()) is listing


def test_pages_are_newest_first_and_cover_every_match_once():
    listing = SandboxList(sandboxes=[info(i) for i in (3, 1, 4, 0, 2)])
    first = select(listing, SandboxQuery(limit=2))
    assert [s.id for s in first.sandboxes] == ["sb-n.0004", "sb-n.0003"] and first.total == 5 and first.next_offset == 2
    last = select(listing, SandboxQuery(limit=2, offset=4))
    assert [s.id for s in last.sandboxes] == ["sb-n.0000"] and last.next_offset is None
    assert select(listing, SandboxQuery(limit=2, offset=9)).sandboxes == []


def test_filters_by_project_labels_and_states():
    listing = SandboxList(sandboxes=[info(1, job="a"), info(2, "p2", job="a"), info(3, job="b"),
                                     info(4, state=SandboxState.failed, job="a")])
    q = SandboxQuery(project="p1", labels={"job": "a"}, states=frozenset({SandboxState.running, SandboxState.failed}))
    assert [s.id for s in select(listing, q).sandboxes] == ["sb-n.0004", "sb-n.0001"]
    assert q.wants_ended and not SandboxQuery(states=frozenset({SandboxState.running})).wants_ended


def test_labels_parse_or_name_the_field():
    assert parse_labels(["job=a", "x/y=b=c", "empty="]) == {"job": "a", "x/y": "b=c", "empty": ""}
    for bad in ("no-equals", "=v", "bad key=v"):
        with pytest.raises(InvalidArgument) as e:
            parse_labels([bad])
        assert e.value.field == "label"
