"""The stock e2b SDK's Volume file methods (the volume content API, apiserver/e2b/volume_content.py)
on dsec's volumes: write, read, list, make_dir, get_info, update_metadata, exists, remove without
a sandbox; a sandbox that mounts the volume sees the files with the same owner, and the API
sees what the sandbox wrote. The volume's token opens that volume only."""

from __future__ import annotations

import secrets

import httpx
import pytest

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import Sandbox, Volume
from e2b.exceptions import NotFoundException, SandboxException


@pytest.fixture(scope="module")
def vol(e2b_env):
    v = Volume.create(f"files-{secrets.token_hex(4)}")
    yield v
    Volume.destroy(v.volume_id)


def test_files_without_a_sandbox(vol):
    e = vol.write_file("/dir/sub/a.txt", "hello volume")          # parents made
    assert (e.name, e.path, e.size, e.uid, e.gid) == ("a.txt", "/dir/sub/a.txt", 12, 1000, 1000)
    assert vol.read_file("/dir/sub/a.txt") == "hello volume"
    assert vol.read_file("dir/sub/a.txt", format="bytes") == b"hello volume"
    vol.write_file("/dir/sub/a.txt", b"shorter")                   # overwrites whole
    assert vol.read_file("/dir/sub/a.txt") == "shorter"
    d = vol.make_dir("/made", mode=0o750)
    assert (d.type.value if hasattr(d.type, "value") else d.type) == "directory" and d.mode == 0o750
    listed = {x.path: x for x in vol.list("/", depth=3)}
    assert {"/dir", "/dir/sub", "/dir/sub/a.txt", "/made"} <= set(listed), listed
    info = vol.get_info("/dir/sub/a.txt")
    assert info.size == 7 and info.mode == 0o644
    assert vol.update_metadata("/dir/sub/a.txt", mode=0o600).mode == 0o600
    assert vol.exists("/dir/sub/a.txt") and not vol.exists("/nope")
    with pytest.raises(NotFoundException):
        vol.read_file("/nope")
    vol.remove("/dir")                                            # a directory with what it holds
    assert not vol.exists("/dir/sub/a.txt") and not vol.exists("/dir")


def test_a_sandbox_and_the_api_see_the_same_files(vol):
    vol.write_file("/shared/from-api.txt", "written by the API\n")
    sb = Sandbox.create("busybox", timeout=120, volume_mounts={"/data": vol})
    try:
        r = sb.commands.run("cat /data/shared/from-api.txt; stat -c '%u:%g' /data/shared/from-api.txt; "
                            "echo from-sandbox > /data/shared/from-sb.txt")
        assert r.stdout == "written by the API\n1000:1000\n", r.stdout
        assert vol.read_file("/shared/from-sb.txt") == "from-sandbox\n"
        assert vol.get_info("/shared/from-sb.txt").uid == 1000          # the sandbox's user
    finally:
        sb.kill()


def test_the_token_opens_its_own_volume_only(vol, e2b_env):
    other = Volume.create(f"files-{secrets.token_hex(4)}")
    try:
        other.write_file("/secret", "other's")
        assert other.token and other.token != vol.token
        url = f"{e2b_env}/volumecontent/{other.volume_id}/file"
        for headers in ({"Authorization": f"Bearer {vol.token}"}, {}, {"Authorization": "Bearer ev_0"}):
            r = httpx.get(url, params={"path": "/secret"}, headers=headers)
            assert r.status_code == 401 and "token" in r.json()["message"], (headers, r.text)
        assert Volume.connect(other.volume_id).read_file("/secret") == "other's"   # with the API key: its token
    finally:
        Volume.destroy(other.volume_id)


def test_a_vm_with_a_volume_is_refused_naming_the_ways_that_work(vol):
    """No volumes in VMs (no 9p in the guest kernel; virtiofs would stop clones, snapshots,
    forks and parking): refused before anything starts, naming both ways around it."""
    with pytest.raises(SandboxException) as e:
        Sandbox.create("busybox", timeout=60, metadata={"dsec.backend": "microvm"}, volume_mounts={"/data": vol})
    msg = str(e.value)
    assert "volumeMounts" in msg and "container" in msg and "dsec volume cp" in msg, msg
