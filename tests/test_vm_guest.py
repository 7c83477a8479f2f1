"""The VM guest side, booted for real: Debian's cloud kernel + the project's initramfs under
QEMU (TCG on this host), the built-in busybox image's EROFS layer as the root's lower layer, an
ext4 upper disk, and the unchanged agent protocol over the virtio-serial port `dsec.agent`.

Every VM is a foreground QEMU child of the test, killed at the end of its test. Timings
(boot to agent ready, reconnect, idle RSS) are printed; run with -s to see them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator

import pytest

from dsec import procstat
from dsec.agent.client import AgentClient, Exit, Output
from dsec.backends.vm import guest
from dsec.config import Paths

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="building the EROFS image needs root"),
]

BOOT_TIMEOUT_S = 90.0   # TCG boots take ~2-3 s here; a loaded CI box is much slower


@pytest.fixture(scope="module")
def kernel() -> guest.KernelFiles:
    """The guest kernel in the node's DSEC_HOME (what `dsec vm fetch-kernel` / install.sh
    fetch); fetched here if apt can, since it is an install-time artefact shared by homes."""
    try:
        return guest.ensure_kernel(Paths.from_env())
    except (guest.GuestError, OSError) as e:
        have = guest.installed_kernel(Paths.from_env())
        if have is None:
            pytest.skip(f"guest kernel not fetched and apt cannot download {guest.KERNEL_META_PACKAGE}: {e}")
        return have


@pytest.fixture(scope="module")
def home() -> Path:
    from conftest import _cleanup_home, link_downloads
    h = Path(tempfile.mkdtemp(prefix="dsec-vmtest-", dir="/var/tmp"))
    link_downloads(h)
    Paths(h).ensure()
    yield h
    _cleanup_home(h)


@pytest.fixture(scope="module")
def busybox_layers(home: Path) -> list[Path]:
    from dsec.images.builtin import ensure_builtin
    from dsec.images.service import ImageService
    svc = ImageService(Paths(home))
    info = ensure_builtin(svc, "busybox")
    return [svc.layer_path(lay.digest) for lay in info.layers]   # base first


@pytest.fixture(scope="module")
def initramfs(home: Path, kernel: guest.KernelFiles) -> Path:
    path = guest.build_initramfs(Paths(home), kernel)
    print(f"\ninitramfs {path.name}: {path.stat().st_size / 2**20:.2f} MiB (uncompressed cpio)")
    return path


class VM:
    """One foreground QEMU; `async with VM(...)` boots it and yields a connected AgentClient."""

    def __init__(self, boot: guest.GuestBoot):
        self.boot = boot
        self.proc: subprocess.Popen | None = None
        self.client: AgentClient | None = None
        self.ready_s = 0.0

    def console(self) -> str:
        try:
            return self.boot.console_log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    async def connect(self, deadline: float) -> AgentClient:
        """Connect as soon as QEMU listens; the PING waits in QEMU (the guest port is closed, so
        QEMU does not read the socket) and is answered once the agent runs in the guest."""
        while not self.boot.agent_socket.exists():
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"QEMU exited {self.proc.returncode}; console:\n{self.console()}")
            if time.monotonic() > deadline:
                raise AssertionError("QEMU did not create the agent socket")
            await asyncio.sleep(0.005)
        # connect() itself PINGs; give it the whole boot budget (a loaded host boots slowly)
        c = await AgentClient.connect(self.boot.agent_socket, timeout=max(1.0, deadline - time.monotonic()))
        ping = asyncio.ensure_future(c.ping())
        while not ping.done():
            await asyncio.wait([ping], timeout=0.1)
            if not ping.done() and (time.monotonic() > deadline
                                    or (self.proc is not None and self.proc.poll() is not None)):
                ping.cancel()
                await c.close()
                raise AssertionError(f"agent not ready (QEMU rc {self.proc.returncode if self.proc else None});"
                                     f" console:\n{self.console()}")
        ping.result()
        return c

    async def __aenter__(self) -> "VM":
        argv = guest.qemu_argv(self.boot)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        try:
            self.client = await self.connect(t0 + BOOT_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=30)

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.close()
        self.kill()


def make_boot(tmp: Path, kernel: guest.KernelFiles, initramfs: Path, layers: list[Path], *,
              machine: str = "microvm", pmem: bool = False, upper: Path | None = None,
              extra: tuple[str, ...] = ()) -> guest.GuestBoot:
    tmp.mkdir(parents=True, exist_ok=True)
    if upper is None:
        upper = tmp / "upper.img"
        guest.make_upper_disk(upper, 256)
    if pmem:
        layers = [guest.pmem_image(p, tmp / "pmem") for p in layers]
    return guest.GuestBoot(machine=machine, kernel=kernel, initramfs=initramfs, layers=layers,  # type: ignore[arg-type]
                           upper=upper, agent_socket=tmp / "agent.sock", console_log=tmp / "console.log",
                           pmem=pmem, workdir="/work", uid=1000, gid=1000, extra_cmdline=extra)


async def run(c: AgentClient, cmd: str, chan: int = 1, uid: int = 0) -> tuple[int, str, str]:
    out, err, code = b"", b"", None
    async for ev in c.exec(chan, cmd=cmd, uid=uid, gid=uid):
        if isinstance(ev, Output):
            if ev.stream == "stdout":
                out += ev.data
            else:
                err += ev.data
        elif isinstance(ev, Exit):
            code = ev.exit_code
    await c.release(chan)
    assert code is not None
    return code, out.decode(), err.decode()


def debugfs_cat(image: Path, path: str) -> str:
    """Read a file from the ext4 upper disk on the host without mounting it."""
    return subprocess.run(["debugfs", "-R", f"cat {path}", str(image)], capture_output=True,
                          text=True, check=True).stdout


async def check_sandbox(c: AgentClient) -> None:
    """The common checks: exec, the agent is PID 1, file ops, an overlay root that is writable."""
    assert await run(c, "echo hi") == (0, "hi\n", "")
    code, out, _ = await run(c, "cat /proc/1/comm; id -u; pwd; stat -c %u /work", uid=1000)
    assert code == 0 and out.split() == ["agent", "1000", "/work", "1000"], out
    await c.write_file("/work/notes.txt", b"written over virtio-serial\n", uid=1000, gid=1000)
    assert await c.read_file("/work/notes.txt", uid=1000, gid=1000) == b"written over virtio-serial\n"
    assert await run(c, "cat /work/notes.txt") == (0, "written over virtio-serial\n", "")
    code, out, _ = await run(c, "grep ' / ' /proc/mounts")
    assert out.startswith("overlay / overlay ") and "upperdir=/upperfs/upper" in out, out
    # a file of the lower (read-only EROFS) layer, changed in the guest: copied up
    assert (await run(c, "echo changed >> /etc/passwd && tail -1 /etc/passwd"))[1] == "changed\n"
    code, out, _ = await run(c, "touch /.dsec/x")
    assert code != 0, "the agent's tmpfs must be read-only"


async def test_microvm_boot_exec_and_upper_disk(tmp_path: Path, kernel, initramfs, busybox_layers) -> None:
    before = hashlib.sha256(busybox_layers[0].read_bytes()).hexdigest()
    boot = make_boot(tmp_path / "a", kernel, initramfs, busybox_layers)
    async with VM(boot) as vm:
        print(f"\nmicrovm (TCG): boot to agent ready {vm.ready_s:.2f} s")
        await check_sandbox(vm.client)
        await asyncio.sleep(1.0)
        print(f"microvm idle QEMU RSS {vm.rss_mib():.0f} MiB")
        assert (await run(vm.client, "sync"))[0] == 0
    # the writes landed on the upper disk, not on the shared layer file
    assert "written over virtio-serial" in debugfs_cat(boot.upper, "/upper/work/notes.txt")
    assert debugfs_cat(boot.upper, "/upper/etc/passwd").endswith("changed\n")
    assert hashlib.sha256(busybox_layers[0].read_bytes()).hexdigest() == before
    # the same upper disk boots again with its changes (stop to disk / resume relies on it)
    again = make_boot(tmp_path / "b", kernel, initramfs, busybox_layers, upper=boot.upper)
    async with VM(again) as vm:
        assert await run(vm.client, "cat /work/notes.txt; tail -1 /etc/passwd") == (
            0, "written over virtio-serial\nchanged\n", "")


async def test_q35_pmem_dax(tmp_path: Path, kernel, initramfs, busybox_layers) -> None:
    boot = make_boot(tmp_path, kernel, initramfs, busybox_layers, machine="q35", pmem=True)
    async with VM(boot) as vm:
        print(f"\nq35 + pmem/DAX (TCG): boot to agent ready {vm.ready_s:.2f} s")
        await check_sandbox(vm.client)
        code, out, _ = await run(vm.client, "ls /sys/block; ls /dev/vd*; dmesg | grep -ci dax")
        assert code == 0 and "pmem0" in out.split(), out
        assert out.split()[-1] != "0", "EROFS should report DAX in dmesg: " + out
        await asyncio.sleep(1.0)
        print(f"q35 + pmem idle QEMU RSS {vm.rss_mib():.0f} MiB")


async def test_q35_virtio_blk(tmp_path: Path, kernel, initramfs, busybox_layers) -> None:
    boot = make_boot(tmp_path, kernel, initramfs, busybox_layers, machine="q35")
    async with VM(boot) as vm:
        print(f"\nq35 virtio-blk (TCG): boot to agent ready {vm.ready_s:.2f} s")
        await check_sandbox(vm.client)
        await asyncio.sleep(1.0)
        print(f"q35 idle QEMU RSS {vm.rss_mib():.0f} MiB")


async def test_reconnect_keeps_commands_and_output(tmp_path: Path, kernel, initramfs, busybox_layers) -> None:
    boot = make_boot(tmp_path, kernel, initramfs, busybox_layers)
    async with VM(boot) as vm:
        c = vm.client
        stream: AsyncIterator = await c.start_exec(7, cmd="echo started; sleep 1.5; echo finished", uid=0, gid=0)
        first = await stream.__anext__()
        assert isinstance(first, Output) and first.data == b"started\n"
        await c.close()            # the host side of the port goes away mid-command
        await asyncio.sleep(0.3)   # output produced now is retained, not written to the port
        t0 = time.monotonic()
        vm.client = c = await AgentClient.connect(boot.agent_socket)
        await asyncio.wait_for(c.ping(), 5)
        print(f"\nreconnect to a responsive agent: {(time.monotonic() - t0) * 1000:.1f} ms")
        out, exit_ = b"", None
        async for ev in c.attach(7):
            if isinstance(ev, Output):
                out += ev.data
            else:
                exit_ = ev
        assert out == b"started\nfinished\n" and exit_ is not None and exit_.exit_code == 0
        assert await run(c, "echo again", chan=8) == (0, "again\n", "")
        # several quick reconnects in a row, each a fresh connection
        for i in range(3):
            await c.close()
            vm.client = c = await AgentClient.connect(boot.agent_socket)
            assert await run(c, f"echo {i}", chan=9) == (0, f"{i}\n", "")
        # idle and disconnected: the agent must not spin (SIGIO/backoff, not a busy poll)
        await c.close()
        vm.client = None
        cpu0 = procstat.cpu_s(vm.proc.pid)
        await asyncio.sleep(2.0)
        busy = (procstat.cpu_s(vm.proc.pid) - cpu0) / 2.0
        print(f"QEMU CPU while the host side is away: {busy * 100:.0f}% of a core")
        vm.client = c = await AgentClient.connect(boot.agent_socket)
        assert await run(c, "echo back", chan=10) == (0, "back\n", "")
        assert busy < 0.5, f"guest busy while disconnected: {busy:.2f} of a core"


async def test_init_failure_stops_the_vm(tmp_path: Path, kernel, initramfs, busybox_layers) -> None:
    """A missing disk: init says why on the console, the kernel panics, QEMU exits by itself."""
    boot = make_boot(tmp_path, kernel, initramfs, busybox_layers,
                     extra=("dsec.layers=2", "dsec.wait_ms=300"))
    proc = subprocess.Popen(guest.qemu_argv(boot), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=BOOT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = boot.console_log.read_text(errors="replace")
    assert "dsec-init: error: timed out waiting for disk dsec-l1" in log, log[-2000:]
    assert "Kernel panic" in log


def test_kernel_cmdline_contract() -> None:
    line = guest.kernel_cmdline(layers=3, pmem=True, workdir="/w", uid=5, gid=6, nofile=100,
                                tsc_khz=2000000)
    for part in ("console=ttyS0", "panic=-1", "tsc_early_khz=2000000", "dsec.layers=3", "dsec.pmem=1",
                 "dsec.workdir=/w", "dsec.uid=5", "dsec.gid=6", "dsec.nofile=100"):
        assert part in line.split()
    with pytest.raises(ValueError):
        guest.kernel_cmdline(layers=1, workdir="/with space")
    with pytest.raises(ValueError):
        guest.kernel_cmdline(layers=0)


def test_module_resolution(kernel) -> None:
    mods = [n for n, _ in guest.resolve_modules(kernel.modules, ["virtio_blk", "erofs", "nd_pmem"])]
    # dependencies come first; built-ins (ext4, dax on this kernel) are left out
    assert mods.index("virtio_ring") < mods.index("virtio") < mods.index("virtio_blk")
    assert mods.index("libnvdimm") < mods.index("nd_pmem")
    assert "ext4" not in [n for n, _ in guest.resolve_modules(kernel.modules, ["ext4"])]
