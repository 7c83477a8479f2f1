"""Bench for D29: host RSS of a microVM guest that fills and frees memory, with the
virtio-balloon's free page reporting on (dsec's default) vs off (the control).
Run: .venv/bin/python benchmarks/vm_balloon.py
Foreground QEMU (TCG), the guest of tests/test_vm_guest.py: busybox layer, 512 MiB RAM."""
from __future__ import annotations

import asyncio, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, "tests")
from test_vm_guest import VM, make_boot, run  # noqa: E402
from conftest import _cleanup_home, link_downloads  # noqa: E402
from dsec.backends.vm import guest  # noqa: E402
from dsec.config import Paths  # noqa: E402
from dsec.images.builtin import ensure_builtin  # noqa: E402
from dsec.images.service import ImageService  # noqa: E402

FILL = 200


class BenchVM(VM):
    async def connect(self, deadline: float):   # QEMU binds the socket a moment before it listens
        while True:
            try:
                return await super().connect(deadline)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


async def one(tmp: Path, kernel, initrd, layers, reporting: bool) -> dict:
    boot = make_boot(tmp, kernel, initrd, layers)
    boot.memory_mb = 512
    orig = guest.qemu_argv
    if not reporting:
        guest.qemu_argv = lambda b, q="qemu-system-x86_64": [  # type: ignore[assignment]
            a.replace("free-page-reporting=on", "free-page-reporting=off") for a in orig(b, q)]
    try:
        async with BenchVM(boot) as vm:
            assert vm.client is not None
            await asyncio.sleep(3)
            idle = vm.rss_mib()
            code, out, err = await run(vm.client, f"dd if=/dev/zero of=/dev/shm/f bs=1M count={FILL} 2>&1")
            assert code == 0, (out, err)
            filled = vm.rss_mib()
            await run(vm.client, "rm /dev/shm/f", chan=2)
            t0 = time.monotonic()
            series = []
            while time.monotonic() - t0 < 20:
                await asyncio.sleep(1)
                series.append(round(vm.rss_mib()))
            return {"reporting": reporting, "idle": round(idle), "filled": round(filled),
                    "after_20s": series[-1], "series": series}
    finally:
        guest.qemu_argv = orig


async def main() -> None:
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-balloon-", dir="/var/tmp"))
    try:
        link_downloads(home)
        Paths(home).ensure()
        svc = ImageService(Paths(home))
        info = ensure_builtin(svc, "busybox")
        layers = [svc.layer_path(lay.digest) for lay in info.layers]
        kernel = guest.installed_kernel(Paths.from_env())
        initrd = guest.build_initramfs(Paths(home), kernel)
        for reporting in (True, False):
            print(await one(home / f"vm-{reporting}", kernel, initrd, layers, reporting), flush=True)
    finally:
        _cleanup_home(home)


asyncio.run(main())
