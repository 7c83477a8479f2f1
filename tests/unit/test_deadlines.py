"""The reaper's deadline heap: only what is due comes out, earlier deadlines win, and forgotten
or replaced entries never come out."""

from __future__ import annotations

from dsec.edge.deadlines import Deadlines
from dsec.edge.load import NodeLoad
from dsec.edge.records import SandboxRecord
from dsec.types import ContainerArgs, SandboxState


def test_only_due_entries_come_out_in_order() -> None:
    d = Deadlines()
    for i in range(1000):
        d.push(f"s{i}", 100.0 + i)
    assert d.due(99.0) == []
    assert d.due(102.0) == ["s0", "s1", "s2"]
    assert len(d) == 997


def test_an_earlier_deadline_replaces_a_later_one_and_not_the_reverse() -> None:
    d = Deadlines()
    d.push("a", 50.0)
    d.push("a", 80.0)          # later: the pending 50 stays (the reaper re-reads times then)
    d.push("b", 50.0)
    d.push("b", 10.0)          # earlier: replaces
    assert d.due(20.0) == ["b"]
    assert d.due(60.0) == ["a"]
    assert d.due(1000.0) == []  # the replaced entries are stale, never due again


def test_forgotten_sandboxes_never_come_due() -> None:
    d = Deadlines()
    d.push("gone", 1.0)
    d.forget("gone")
    assert d.due(5.0) == [] and len(d) == 0


def _rec(i: int, cpu: float, mem: int, state: SandboxState = SandboxState.running) -> SandboxRecord:
    args = ContainerArgs(image="busybox", cpu_cores=cpu, memory_mb=mem)
    return SandboxRecord(id=f"sb-local.{i:012x}", project="p", backend="container", state=state, args=args,
                         image="busybox", image_digest=None, uid=1000, gid=1000, created_at=0.0, last_active_at=0.0)


def test_node_load_keeps_exact_totals_through_state_changes() -> None:
    load = NodeLoad()
    recs = [_rec(i, 0.005, 48) for i in range(3200)]
    for r in recs:
        load.update(r, live=True)
    assert (load.sandboxes, load.cpu_cores, load.memory_mb) == (3200, 16.0, 3200 * 48)
    recs[0].state = SandboxState.suspended         # parked: holds nothing
    load.update(recs[0], live=True)
    recs[1].state = SandboxState.stopping
    load.update(recs[1], live=True)
    load.update(recs[2], live=False)               # gone from the edge
    assert (load.sandboxes, load.memory_mb) == (3197, 3197 * 48)
    recs[0].state = SandboxState.running           # resumed
    load.update(recs[0], live=True)
    load.update(recs[0], live=True)                # repeated reports do not count twice
    assert (load.sandboxes, load.cpu_cores) == (3198, 3198 * 0.005)
