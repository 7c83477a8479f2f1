"""Masked directories (/proc/acpi, /sys/firmware, /sys/kernel/{debug,security}, ...): empty,
read-only and fixed even for root in the sandbox, and not a superblock per sandbox each
(every superblock grows every memory cgroup's shrinker map; D35)."""

from __future__ import annotations

import pytest

from dsec.backends.container.spec import masked_dirs

IMAGE = "debian-python"


@pytest.mark.skipif(not masked_dirs(), reason="this kernel has none of the masked directories")
async def test_masked_dirs_are_empty_read_only_and_stay(client):
    async with await client.create_container(image=IMAGE, user="root") as sb:
        for d in masked_dirs():
            r = await sb.run(f"ls -A {d} | wc -l; touch {d}/x; echo touch=$?; umount {d}; echo umount=$?;"
                             f" mount -t tmpfs t {d}; echo mount=$?; ls -A {d} | wc -l")
            lines = r.stdout.split()
            assert lines[0] == "0", (d, r)                          # empty
            assert lines[1] != "touch=0" and lines[2] != "umount=0" and lines[3] != "mount=0", (d, r)
            assert lines[4] == "0", (d, r)                          # still the empty mask


async def test_sandbox_superblocks_are_few(client):
    """Distinct superblocks a sandbox mounts (mountinfo's major:minor): overlay root, proc, /dev,
    devpts, /dev/shm, mqueue, sysfs and the agent's host filesystem; the masks add none."""
    async with await client.create_container(image=IMAGE) as sb:
        r = await sb.run("cat /proc/self/mountinfo")
        table = [line.split() for line in r.stdout.splitlines()]
        # binds of host files, and of the node's one lxcfs (D50: shared by every sandbox)
        host = {f[2] for f in table if f[4] in ("/.dsec/agent", "/dev/null", "/proc/meminfo")}
        masks = [f for f in table if f[4] in masked_dirs()]
        assert len(masks) == len(masked_dirs()) and {f[2] for f in masks} <= host, masks
        own = {f[2] for f in table} - host
        assert len(own) <= 7, sorted(own)
