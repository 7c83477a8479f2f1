"""cgroups.oom_from_above on cgroup trees written as the kernel shows them (v2 cannot be run on
these cgroup-v1 hosts; v1 is also tested for real in tests/test_end_reasons_infra.py), as the
pressure probe is tested on fake /proc trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.backends.container import cgroups

MiB = 1 << 20


def _v2(root: Path, events: str) -> None:
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    d = root / "dsec" / "sb"
    d.mkdir(parents=True)
    (d / "memory.events").write_text(events)


def _v1(root: Path, kills: int, limit: int, peak: int, memsw: tuple[int, int] | None = None) -> None:
    d = root / "memory" / "dsec" / "sb"
    d.mkdir(parents=True)
    (d / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
    (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (d / "memory.max_usage_in_bytes").write_text(f"{peak}\n")
    (d / "memory.failcnt").write_text("0\n")         # kernel 6.18 v1: 0 even after an own-limit OOM
    if memsw is not None:
        (d / "memory.memsw.limit_in_bytes").write_text(f"{memsw[0]}\n")
        (d / "memory.memsw.max_usage_in_bytes").write_text(f"{memsw[1]}\n")


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", tmp_path)
    return tmp_path


@pytest.mark.parametrize("events, above", [
    ("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n", False),   # its own memory.max
    ("low 0\nhigh 0\nmax 0\noom 0\noom_kill 1\noom_group_kill 0\n", True),    # a parent's or the host's
    ("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n", False),   # no OOM kill at all
])
def test_v2_memory_events(root, events, above):
    _v2(root, events)
    assert cgroups.oom_from_above("/dsec/sb") is above


@pytest.mark.parametrize("kills, limit, peak, memsw, above", [
    (1, 32 * MiB, 32 * MiB, None, False),                         # reached its own limit
    (1, 32 * MiB, 32 * MiB - 200 * 1024, None, False),            # within a charge batch of it
    (1, 512 * MiB, 96 * MiB, None, True),                         # far below: the parent's limit
    (1, 512 * MiB, 96 * MiB, (512 * MiB, 512 * MiB), False),      # memory+swap reached its own limit
    (1, 512 * MiB, 96 * MiB, (512 * MiB, 100 * MiB), True),
    (0, 512 * MiB, 96 * MiB, None, False),                        # no OOM kill: nothing to tell
])
def test_v1_high_water_mark(root, kills, limit, peak, memsw, above):
    _v1(root, kills, limit, peak, memsw)
    assert cgroups.oom_from_above("/dsec/sb") is above


def test_unreadable_is_not_blamed_on_the_host(root):
    d = root / "memory" / "dsec" / "sb"
    d.mkdir(parents=True)
    (d / "memory.oom_control").write_text("oom_kill 1\n")
    assert cgroups.oom_from_above("/dsec/sb") is False
