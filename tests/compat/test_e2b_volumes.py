"""The stock e2b SDK's Volume API (create, list, get_info, destroy) and
Sandbox.create(volume_mounts=...) on dsec's volumes: files one sandbox writes, another sees;
the volume outlives both; another project's key does not find it."""

from __future__ import annotations

import secrets

import pytest
from conftest import stranger_key

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import Sandbox, Volume
from e2b.exceptions import SandboxException, VolumeException


def test_volume_shared_by_sandboxes_and_outliving_them(e2b_env, server):
    name = f"e2b-{secrets.token_hex(4)}"
    vol = Volume.create(name)
    try:
        assert vol.name == name and vol.volume_id.startswith("vol-")
        assert name in [v.name for v in Volume.list()]
        assert Volume.get_info(vol.volume_id).name == name
        a = Sandbox.create("busybox", timeout=120, volume_mounts={"/mnt/data": vol})
        try:
            assert a.get_info().volume_mounts == [{"name": name, "path": "/mnt/data"}]
            a.commands.run("echo from-a > /mnt/data/f")
            b = Sandbox.create("busybox", timeout=120, volume_mounts={"/data": name})     # by name too
            try:
                assert b.commands.run("cat /data/f").stdout == "from-a\n"
            finally:
                b.kill()
            with pytest.raises(VolumeException, match="mounted by"):
                Volume.destroy(vol.volume_id)                      # in use: refused
        finally:
            a.kill()
        c = Sandbox.create("busybox", timeout=120, volume_mounts={"/again": vol})
        try:
            assert c.commands.run("cat /again/f").stdout == "from-a\n"
        finally:
            c.kill()
        other = stranger_key(server, "e2b-volumes")
        assert name not in [v.name for v in Volume.list(api_key=other)]
        assert Volume.destroy(vol.volume_id, api_key=other) is False      # 404 for another project
        with pytest.raises(SandboxException, match="volume"):
            Sandbox.create("busybox", timeout=60, volume_mounts={"/x": name}, api_key=other)
    finally:
        Volume.destroy(vol.volume_id)
    assert name not in [v.name for v in Volume.list()]
    assert Volume.destroy(vol.volume_id) is False
