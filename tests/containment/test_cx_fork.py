"""Attacks across a fork (D5?, backends/container/snapshots.py): forks of one sandbox share its
snapshot's files copy-on-write, shown to each through a mount idmapped into its own id range.
What one fork (root inside) writes, deletes or changes must reach neither its parent nor its
siblings nor the shared snapshot; each fork stays in its own user namespace range."""

from __future__ import annotations

import json

import pytest



@pytest.fixture(scope="module")
async def family(cx):
    parent = await cx.create_container(image="busybox", env={"FORK_ENV": "yes"}, labels={"fam": "cx"})
    await parent.run("mkdir -p /work/d && echo parent > /work/d/shared.txt && echo keep > /work/keep.txt && "
                     "chmod 600 /work/keep.txt && echo rootfile > /root-owned.txt", user="root")
    await parent.run("echo mine > /work/user.txt")
    forked = await parent.fork(2)
    kids = forked.sandboxes
    assert len(kids) == 2, [c.error for c in forked.forks]
    yield parent, kids, forked
    for sb in (parent, *kids):
        await sb.stop()


async def test_each_fork_sees_the_parents_files_and_owners(family):
    parent, kids, forked = family
    for kid in kids:
        r = await kid.run("cat /work/d/shared.txt /work/user.txt /root-owned.txt; stat -c '%u %a' /work/keep.txt "
                          "/work/user.txt; echo $FORK_ENV", user="root")
        assert r.stdout.split("\n")[:6] == ["parent", "mine", "rootfile", "0 600", "1000 644", "yes"], r.stdout
        assert kid.info.labels.get("fam") == "cx"
    assert any("processes" in n for n in forked.not_carried)


async def test_writes_in_one_fork_reach_no_parent_nor_sibling(family):
    parent, (a, b), _ = family
    await a.run("echo changed-by-a > /work/d/shared.txt; rm /work/keep.txt; echo new > /work/a-only.txt; "
                "rm -rf /work/d2; chmod 777 /work/user.txt; echo planted > /bin/planted", user="root")
    for other in (parent, b):
        r = await other.run("cat /work/d/shared.txt /work/keep.txt; ls /work/a-only.txt /bin/planted 2>&1; "
                            "stat -c %a /work/user.txt", user="root")
        assert r.stdout.startswith("parent\nkeep\n"), r.stdout
        assert "No such file" in r.stdout and r.stdout.rstrip().endswith("644"), r.stdout


async def test_parent_writes_after_the_fork_are_not_seen_by_forks(family):
    parent, (a, b), _ = family
    await parent.run("echo later > /work/later.txt; echo parent2 > /work/d/shared.txt")
    r = await b.run("cat /work/later.txt 2>&1; cat /work/d/shared.txt")
    assert "No such file" in r.stdout and r.stdout.rstrip().endswith("parent"), r.stdout


async def test_forks_run_in_ranges_of_their_own(family, server):
    parent, kids, _ = family
    bases = set()
    for sb in (parent, *kids):
        m = (await sb.run("cat /proc/self/uid_map", user="root")).stdout.split()
        assert m[0] == "0" and m[1] != "0", m
        bases.add(m[1])
    assert len(bases) == 3, bases
    # the shared snapshot cannot be reached from a fork: no host path of it inside
    for kid in kids:
        r = await kid.run("cat /proc/mounts", user="root")
        assert ".snap" not in r.stdout, r.stdout


async def test_a_fork_cannot_change_the_snapshot_its_siblings_stack(family, server):
    """The layer is read-only on the host (a btrfs read-only snapshot): even a write that got
    past the overlay would be refused. Its files are unchanged after the attacks above."""
    parent, kids, _ = family
    snap_root = server.paths.sandboxes / ".snap"
    layers = [p / "fs" / "upper" for p in snap_root.iterdir() if (p / "fs" / "upper").is_dir()
              and json.loads((p / "meta.json").read_text()).get("source") == parent.id]
    assert layers, "the fork's snapshot should live while its forks do"
    for layer in layers:
        assert (layer / "work" / "d" / "shared.txt").read_text() == "parent\n"
        with pytest.raises(OSError):
            (layer / "work" / "x").write_text("x")
