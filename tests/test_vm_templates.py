"""The template cache is bounded (DSEC_VM_TEMPLATES_MAX): its RAM is tmpfs and every image
version or VM size makes a new template. Eviction must never break a VM: a running clone keeps
its private mapping of the evicted RAM, a parked clone its own saved state, and every clone
its link to the template's disk. Own server (limit 1) on its own home."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from dsec.testing.isolated import ServerProcess, cleanup_home, link_node_downloads
from dsec.backends.vm.templates import ram_dir
from dsec.config import Paths

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]


@pytest.fixture(scope="module")
def small_cache_server(server):     # `server`: the session's images and downloads exist
    if not (Paths.from_env().vm / "kernel").is_dir():
        pytest.skip("no guest kernel on this node (dsec vm fetch-kernel)")
    home = Path(tempfile.mkdtemp(prefix="dsec-test-tpl-", dir="/var/tmp"))
    link_node_downloads(home, server.home / "cache")
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService
    paths = Paths(home)
    paths.ensure()
    ensure_builtin(ImageService(paths), "busybox")
    srv = ServerProcess(home, env={"DSEC_VM_TEMPLATES_MAX": "1"})
    srv.start()
    yield srv
    srv.kill(signal.SIGTERM)
    leaked = cleanup_home(home)
    assert not leaked, f"QEMUs outlived the server: {leaked}"


def _templates(srv) -> set[str]:
    return {p.name for p in srv.paths.vm_templates.iterdir()}


def _rams(srv) -> set[str]:
    return {p.stem for p in ram_dir(srv.paths).glob("*.ram")}


async def test_evicted_templates_leave_running_and_parked_clones_working(small_cache_server):
    srv = small_cache_server
    async with srv.client() as c:
        running = await c.create_microvm(image="busybox", memory_mb=256)
        await running.files.write("/work/r", "running")
        first = _templates(srv)
        assert len(first) == 1 and _rams(srv) == first
        parked = await c.create_microvm(image="busybox", memory_mb=288)      # another size: template 2
        await parked.files.write("/work/p", "parked")
        second = _templates(srv) - first
        assert len(second) == 1 and _templates(srv) == second and _rams(srv) == second   # 1 evicted
        await parked.suspend()
        third = await c.create_microvm(image="busybox", memory_mb=320)       # template 3 evicts 2
        try:
            assert len(_templates(srv)) == 1 and not (_templates(srv) & (first | second))
            assert _rams(srv) == _templates(srv)
            assert (await running.run("cat /work/r")).stdout == "running"     # its template is gone
            assert (await parked.run("cat /work/p")).stdout == "parked"       # resumed without it
            again = await c.create_microvm(image="busybox", memory_mb=256)    # template 1 rebuilt
            assert (await again.run("cat /work/r 2>/dev/null || echo new")).stdout == "new\n"
            await again.stop()
        finally:
            for sb in (running, parked, third):
                await sb.stop()
