"""The stock e2b SDK's fork and snapshots against a real dsec server (apiserver/e2b/snapshots.py):
Sandbox.fork(count) gives one result per fork, create_snapshot / list_snapshots /
Sandbox.create(snapshot_id) / delete_snapshot work on dsec's container snapshots."""

from __future__ import annotations

import secrets

import pytest

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException

TEMPLATE = "debian-python"


@pytest.fixture(scope="module")
def parent(e2b_env):
    s = Sandbox.create(TEMPLATE, timeout=600, envs={"FROM": "parent"}, metadata={"suite": "e2b-fork"})
    s.files.write("/home/user/state.txt", "prepared")
    yield s
    s.kill()


def test_fork_gives_one_running_sandbox_per_fork(parent):
    end_before = parent.get_info().end_at
    forks = parent.fork(count=2, timeout=120)
    assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
    try:
        for f in forks:
            assert f.sandbox_id != parent.sandbox_id and f.is_running()
            assert f.files.read("/home/user/state.txt") == "prepared"
            r = f.commands.run("echo $FROM; whoami; pwd")
            assert r.stdout == "parent\nuser\n/home/user\n", r.stdout
            assert f.get_info().metadata == {"suite": "e2b-fork"}
            assert (f.get_info().end_at - f.get_info().started_at).total_seconds() <= 121
        forks[0].files.write("/home/user/state.txt", "changed in fork 0")
        assert forks[1].files.read("/home/user/state.txt") == "prepared"
        assert parent.files.read("/home/user/state.txt") == "prepared"
        assert parent.is_running() and parent.get_info().end_at == end_before
    finally:
        for f in forks:
            f.kill()


def test_fork_count_is_checked(parent):
    with pytest.raises((InvalidArgumentException, SandboxException)):
        Sandbox.fork(parent.sandbox_id, count=0)


def test_snapshot_create_list_restore_delete(parent):
    snap = parent.create_snapshot(mode="filesystem")
    assert snap.snapshot_id.startswith("snap-")
    listed = [s.snapshot_id for s in parent.list_snapshots().next_items()]
    assert snap.snapshot_id in listed
    assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
    made = Sandbox.create(snap.snapshot_id, timeout=120)
    try:
        assert made.files.read("/home/user/state.txt") == "prepared"
        assert made.commands.run("echo $FROM").stdout == "parent\n"
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert snap.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        made.files.write("/home/user/after.txt", "still fine")          # its layer stays while it runs
        assert made.files.read("/home/user/state.txt") == "prepared"
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    finally:
        made.kill()


def test_full_memory_snapshot_of_a_container_is_refused_by_name(parent):
    with pytest.raises(SandboxException) as e:
        parent.create_snapshot(mode="full")
    assert "memory" in str(e.value)


def test_snapshot_names_move_to_the_newest_and_create_by_name(parent):
    name = f"named-{secrets.token_hex(3)}"
    first = parent.create_snapshot(mode="filesystem", name=name)
    assert first.snapshot_id.startswith("snap-") and len(first.names) == 1
    assert first.names[0].endswith(f"/{name}:default"), first.names
    parent.files.write("/home/user/state.txt", "second")
    try:
        second = parent.create_snapshot(mode="filesystem", name=name)     # the name moves to it
    finally:
        parent.files.write("/home/user/state.txt", "prepared")
    try:
        by_name = Sandbox.list_snapshots(name=name).next_items()
        assert [s.snapshot_id for s in by_name] == [second.snapshot_id]
        assert by_name[0].names == second.names
        listed = {s.snapshot_id: s.names for s in Sandbox.list_snapshots().next_items()}
        assert listed[first.snapshot_id] == [] and listed[second.snapshot_id] == second.names
        made = Sandbox.create(name, timeout=120)                       # a create naming it: the newest
        try:
            assert made.files.read("/home/user/state.txt") == "second"
        finally:
            made.kill()
        made = Sandbox.create(first.snapshot_id, timeout=120)          # the older one by its id
        try:
            assert made.files.read("/home/user/state.txt") == "prepared"
        finally:
            made.kill()
    finally:
        assert Sandbox.delete_snapshot(second.snapshot_id) is True
        assert Sandbox.delete_snapshot(first.snapshot_id) is True
    assert Sandbox.list_snapshots(name=name).next_items() == []


def test_bad_or_taken_snapshot_names_are_refused_by_name(parent):
    with pytest.raises(SandboxException) as e:
        parent.create_snapshot(mode="filesystem", name="Not A Name!")
    assert "name" in str(e.value)
    with pytest.raises(SandboxException) as e:
        parent.create_snapshot(mode="filesystem", name=TEMPLATE)       # an image's name
    assert "name" in str(e.value) and "template" in str(e.value)
