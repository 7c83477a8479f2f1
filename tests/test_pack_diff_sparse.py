"""pack_diff of sparse files, through the real server: holes stay holes (in the copy on the
host and in the layer), and a layer is bounded by the sandbox's disk quota.

Before: `truncate -s 1G /work/x` in a disk_mb=64 sandbox, then pack_diff, wrote 1.1 GB to the
host (the copy filled the holes, then mkfs.erofs wrote them out again)."""

from __future__ import annotations

import pytest

from dsec.types import DsecError

MIB = 1 << 20


def _written(pid: int) -> int:
    """Bytes the server (its threads and reaped children: mkfs.erofs) caused to be written to
    storage (/proc/PID/io write_bytes)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def _new_build_dirs(server) -> list:
    build = server.paths.home / "build"
    return [d for d in build.iterdir() if d.name.startswith("diff-")] if build.exists() else []


async def test_sparse_files_stay_sparse_in_the_layer(client, server):
    pid = server.proc.pid
    async with await client.create_container(image="busybox", user="root", disk_mb=64) as sb:
        r = await sb.run("truncate -s 48M /work/sparse && printf data | dd of=/work/sparse bs=1 seek=10000000 "
                         "conv=notrunc status=none && md5sum /work/sparse && ls -s /work/sparse", check=True)
        md5 = r.stdout.split()[0]
        before = _written(pid)
        layer = await sb.pack_diff("sparse-ws@1")
        written = _written(pid) - before
    assert written < 8 * MIB, f"pack_diff wrote {written >> 20} MiB for 4 KiB of data"
    assert layer.layers[-1].size_bytes < 2 * MIB, layer
    async with await client.create_container(image="busybox", workspace="sparse-ws@1") as sb2:
        r = await sb2.run("stat -c %s /work/sparse; md5sum /work/sparse", check=True)
        assert r.stdout.split()[:2] == [str(48 * MIB), md5]


async def test_a_layer_larger_than_disk_mb_is_refused_before_anything_is_written(client, server):
    pid = server.proc.pid
    async with await client.create_container(image="busybox", user="root", disk_mb=64) as sb:
        await sb.run("truncate -s 1G /work/x && echo hi > /work/y", check=True)
        before = _written(pid)
        with pytest.raises(DsecError) as e:
            await sb.pack_diff("too-big@1")
        written = _written(pid) - before
        assert e.value.field == "disk_mb" and "disk_mb=64" in e.value.message, e.value
        assert "/work/x 1024 MiB" in e.value.message and e.value.fix
        assert written < 8 * MIB, f"a refused pack_diff wrote {written >> 20} MiB"
        assert _new_build_dirs(server) == []
        with pytest.raises(DsecError):
            await client.create_container(image="busybox", workspace="too-big@1")   # nothing registered
        # what fits is packed: the same sandbox once the big file is gone
        await sb.run("rm /work/x", check=True)
        assert (await sb.pack_diff("fits@1")).layers[-1].size_bytes < 2 * MIB
