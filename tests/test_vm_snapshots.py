"""VM snapshot lifecycle through the whole stack (SDK -> apiserver -> edge -> QEMU): list, get,
delete, who may use a snapshot, and that deleting a snapshot, rebuilding a template or a disk
never breaks a VM or a snapshot made over the old files (backends/vm/chain.py)."""

from __future__ import annotations

import os
import shutil

import pytest

from dsec.backends.vm.templates import ram_dir
from dsec.iam import IAM
from dsec.sdk.client import Client
from dsec.types import NotFound

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]


async def _snapshot_with_file(client, path: str, content: str):
    """A microVM that wrote `path`, snapshotted and stopped: (its info, the snapshot)."""
    sb = await client.create_microvm(image="busybox", memory_mb=256)
    try:
        await sb.files.write(path, content)
        return sb.info, await sb.snapshot()
    finally:
        await sb.stop()


async def test_snapshot_list_get_delete_and_restored_vms_outlive_it(vm_client, server):
    src, snap = await _snapshot_with_file(vm_client, "/work/s", "saved")
    assert (snap.backend, snap.image, snap.sandbox_id) == ("microvm", "busybox", src.id)
    assert snap.project == src.project and snap.size_bytes > 0
    assert {s.id: s for s in await vm_client.snapshots()}[snap.id] == snap
    assert await vm_client.get_snapshot(snap.id) == snap

    twin = await vm_client.create_microvm(image="busybox", snapshot=snap.id)
    try:
        await vm_client.delete_snapshot(snap.id)
        assert not (server.paths.vm_snapshots / snap.id).exists()
        assert snap.id not in {s.id for s in await vm_client.snapshots()}
        for gone in (lambda: vm_client.get_snapshot(snap.id), lambda: vm_client.delete_snapshot(snap.id),
                     lambda: vm_client.create_microvm(image="busybox", snapshot=snap.id)):
            with pytest.raises(NotFound) as e:
                await gone()
            assert e.value.field in ("snapshot_id", "snapshot") and "dsec vm snapshot ls" in (e.value.fix or "")
        # the VM restored from it runs on, parks and resumes over its own links to the disk ...
        assert await twin.files.read_text("/work/s") == "saved"
        await twin.suspend()
        assert (await twin.run("cat /work/s")).stdout == "saved"
        # ... and a snapshot of it restores, though the snapshot its disk came from is gone
        await twin.files.write("/work/t", "second")
        snap2 = await twin.snapshot()
    finally:
        await twin.stop()
    third = await vm_client.create_microvm(image="busybox", snapshot=snap2.id)
    try:
        assert (await third.run("cat /work/s /work/t")).stdout == "savedsecond"
    finally:
        await third.stop()
        await vm_client.delete_snapshot(snap2.id)
    assert not [p.name for p in server.paths.vm_snapshots.iterdir() if p.name.startswith(".")]   # no half-deleted dirs


async def test_snapshots_and_parked_clones_outlive_a_template_rebuild(vm_client, server):
    """Template RAM lives on tmpfs: after a reboot it is gone and the next clone rebuilds the
    template (removing its old disk). Clones parked on disk and snapshots of clones keep the
    disk they were made over."""
    a = await vm_client.create_microvm(image="busybox", memory_mb=256)
    snap = None
    try:
        await a.files.write("/work/f", "from-a")
        snap = await a.snapshot()
        link, = (server.paths.vm_sandboxes / a.id).glob("chain-tpl-*.img")
        key = link.name.removeprefix("chain-tpl-").removesuffix(".img")
        template_disk = server.paths.vm_templates / key / "upper.img"
        old_inode = template_disk.stat().st_ino
        await a.suspend()
        (ram_dir(server.paths) / f"{key}.ram").unlink()          # what a reboot does
        b = await vm_client.create_microvm(image="busybox", memory_mb=256)
        try:
            assert template_disk.stat().st_ino != old_inode       # rebuilt: a new disk
            assert (await b.run("cat /work/f 2>/dev/null || echo fresh")).stdout == "fresh\n"
        finally:
            await b.stop()
        assert await a.files.read_text("/work/f") == "from-a"    # resumed over its own link
        twin = await vm_client.create_microvm(image="busybox", snapshot=snap.id)
        try:
            assert await twin.files.read_text("/work/f") == "from-a"
        finally:
            await twin.stop()
    finally:
        await a.stop()
        if snap is not None:
            await vm_client.delete_snapshot(snap.id)


@pytest.fixture
def projects(server):
    """parent -> child, and an unrelated project; a key for each."""
    sfx = os.urandom(3).hex()
    with IAM(server.paths.iam_db) as iam:
        parent = iam.create_project(f"snap-parent-{sfx}", iam.root().id)
        child = iam.create_project(f"snap-child-{sfx}", parent.id)
        other = iam.create_project(f"snap-other-{sfx}", iam.root().id)
        return {name: (p.id, iam.create_key(p.id)) for name, p in
                (("parent", parent), ("child", child), ("other", other))}


async def test_other_projects_cannot_see_restore_or_delete_a_snapshot(vm_client, server, projects):
    """A snapshot holds a guest's memory and disk: only its project and that project's ancestors
    reach it. To anyone else its id is a 404, whichever route names it."""
    (parent_id, parent_key), (child_id, child_key), (_, other_key) = (
        projects["parent"], projects["child"], projects["other"])
    async with Client(server.url, child_key) as child, Client(server.url, other_key) as other, \
            Client(server.url, parent_key) as parent:
        _, snap = await _snapshot_with_file(child, "/work/secret", "child-only")
        assert snap.project == child_id
        assert snap.id not in {s.id for s in await other.snapshots()}
        for attempt in (lambda: other.get_snapshot(snap.id), lambda: other.delete_snapshot(snap.id),
                        lambda: other.create_microvm(image="busybox", snapshot=snap.id)):
            with pytest.raises(NotFound):
                await attempt()
        assert (server.paths.vm_snapshots / snap.id / "state").is_file()     # still there
        # the parent project sees its child's snapshot and may restore it (into its own project)
        assert snap.id in {s.id for s in await parent.snapshots()}
        twin = await parent.create_microvm(image="busybox", snapshot=snap.id)
        try:
            assert twin.info.project == parent_id
            assert await twin.files.read_text("/work/secret") == "child-only"
            parents_snap = await twin.snapshot()
        finally:
            await twin.stop()
        # ... but the child cannot reach its parent's
        with pytest.raises(NotFound):
            await child.get_snapshot(parents_snap.id)
        await parent.delete_snapshot(parents_snap.id)
        await child.delete_snapshot(snap.id)


def test_snapshot_cli(server):
    from test_cli import dsec
    sid = dsec(server, "sandbox", "create", "busybox", "--backend", "microvm", "--memory-mb", "256").stdout.strip()
    try:
        snap_id = dsec(server, "sandbox", "snapshot", sid).stdout.split()[0]
    finally:
        dsec(server, "sandbox", "rm", sid)
    assert snap_id.startswith("snap-local.")
    assert snap_id in dsec(server, "vm", "snapshot", "ls").stdout
    assert dsec(server, "vm", "snapshot", "rm", snap_id).stdout.strip() == f"deleted {snap_id}"
    assert snap_id not in dsec(server, "vm", "snapshot", "ls").stdout
    p = dsec(server, "vm", "snapshot", "rm", snap_id, check=False)
    assert p.returncode == 2 and "field: snapshot_id" in p.stderr and "dsec vm snapshot ls" in p.stderr


async def test_layers_of_parked_vms_and_snapshots_survive_removing_their_image(vm_client, server, images,
                                                                               tmp_path):
    """A VM attaches its layer files by path and re-opens them on resume; a snapshot on
    restore. Removing (or rebuilding) the image runs layer GC: it must keep what they hold,
    and free it once the last of them is gone."""
    name = f"snapws-{os.urandom(3).hex()}@1"
    (tmp_path / "ws" / "work").mkdir(parents=True)
    (tmp_path / "ws" / "work" / "task.txt").write_text("task-data\n")
    digest = images.build_layer(name, from_dir=tmp_path / "ws").layers[-1].digest
    layer = images.layer_path(digest)
    sb = await vm_client.create_microvm(image="busybox", workspace=name, memory_mb=256)
    try:
        snap = await sb.snapshot()
        await sb.suspend()
        images.remove(name)                       # runs GC
        assert layer.is_file()
        assert (await sb.run("cat /work/task.txt")).stdout == "task-data\n"    # resumed
        twin = await vm_client.create_microvm(image="busybox", snapshot=snap.id)
        try:
            assert await twin.files.read_text("/work/task.txt") == "task-data\n"
            assert twin.info.image_digest == sb.info.image_digest
        finally:
            await twin.stop()
    finally:
        await sb.stop()
    assert images.gc() == [] and layer.is_file()      # the snapshot still holds it
    await vm_client.delete_snapshot(snap.id)
    assert images.gc() == [digest] and not layer.is_file()
