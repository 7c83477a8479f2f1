"""The stock e2b SDK's sandboxes see their own size (D50): metadata dsec.cpu_cores and
dsec.memory_mb set the limits; nproc, os.cpu_count(), /proc/meminfo and `free` say them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("e2b", reason="the e2b SDK is not installed: pip install -e '.[e2b]'")

from e2b import Sandbox

from test_sandbox_size import SIZE, assert_size


@pytest.mark.parametrize("cores, mb", [(1, 512), (2, 1024)])
def test_stock_sdk_sandbox_sees_its_size(e2b_env, cores, mb):
    s = Sandbox.create("debian-python", timeout=300,
                       metadata={"dsec.cpu_cores": str(cores), "dsec.memory_mb": str(mb)})
    try:
        assert (s.get_info().cpu_count, s.get_info().memory_mb) == (cores, mb)
        r = s.commands.run(SIZE)
        assert_size(json.loads(r.stdout), cores, mb)
    finally:
        s.kill()
