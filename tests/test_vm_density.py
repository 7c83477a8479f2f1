"""What an idle microVM clone costs the host (issue 31): a clone's QEMU starts with a bounded TCG
translation cache and its memory marked mergeable for KSM (DSEC_VM_KSM, default `all`), and a
node set to DSEC_VM_KSM=0 / DSEC_VM_TCG_TB_SIZE_MB=0 starts them without (the kernel's view:
the guest RAM mapping's `mg` flag in smaps, `ksm_merge_any` in /proc/PID/ksm_stat). Clones made
from the template's kept overlay (a copy, not qemu-img) have disks of their own."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import side_server

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]

MEMORY_MB = 256


def _pid(server, sandbox_id: str) -> int:
    return int((server.paths.vm_sandboxes / sandbox_id / "qemu.pid").read_text())


def _argv(server, sandbox_id: str) -> list[str]:
    return (server.paths.vm_sandboxes / sandbox_id / "qemu.argv").read_text().split("\0")


def _guest_ram_flags(pid: int) -> list[str]:
    """VmFlags of the mapping of the guest's RAM (the one of its size)."""
    size_kib, flags = None, None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            size_kib = (int(m[2], 16) - int(m[1], 16)) >> 10
        elif line.startswith("VmFlags:") and size_kib == MEMORY_MB << 10:
            flags = line.split()[1:]
    assert flags is not None, f"no {MEMORY_MB} MiB mapping in QEMU {pid}"
    return flags


def _merge_any(pid: int) -> str | None:
    p = Path(f"/proc/{pid}/ksm_stat")
    if not p.exists():
        return None
    return next(ln.split(":")[1].strip() for ln in p.read_text().splitlines() if ln.startswith("ksm_merge_any"))


def _thp(pid: int) -> tuple[str | None, int]:
    """(THP_enabled from /proc/PID/status (None on kernels without it), AnonHugePages KiB)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    enabled = next((ln.split()[1] for ln in status if ln.startswith("THP_enabled:")), None)
    huge = sum(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
               if ln.startswith("AnonHugePages:"))
    return enabled, huge


def _code_cache_kib(pid: int) -> int:
    """Size of QEMU's anonymous executable mapping: the TCG translation buffer."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        f = line.split()
        if len(f) == 5 and "x" in f[1]:
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            return (hi - lo) >> 10
    raise AssertionError(f"no anonymous executable mapping in QEMU {pid}")


@pytest.fixture(scope="module")
def plain_server(images, dsec_home, tmp_path_factory):
    """A node with merging and the cache bound turned off."""
    # downloads: the guest kernel; without it the node offers no VM backends
    with side_server(dsec_home, tmp_path_factory, "vm-plain", downloads=True,
                     env={"DSEC_VM_KSM": "0", "DSEC_VM_TCG_TB_SIZE_MB": "0", "DSEC_VM_QEMU_THP": "1",
                          "DSEC_VM_RESTORE_STUB_KERNEL": "0"}) as srv:
        yield srv


async def test_clone_starts_bounded_and_mergeable(vm_client, server):
    sb = await vm_client.create_microvm(image="busybox", memory_mb=MEMORY_MB)
    try:
        assert (await sb.run("true")).exit_code == 0
        pid, argv = _pid(server, sb.id), _argv(server, sb.id)
        assert "mem-merge=on" in argv[argv.index("-machine") + 1]
        assert "mg" in _guest_ram_flags(pid)
        if sb.info.accel == "tcg":
            assert argv[argv.index("-accel") + 1] == "tcg,tb-size=32"
            assert _code_cache_kib(pid) <= 32 << 10
        if (merge_any := _merge_any(pid)) is not None:
            assert merge_any == "yes"     # DSEC_VM_KSM=all: QEMU's own memory too (the shim)
        # no huge pages for a restored VM's QEMU (the code cache asks for them): cheaper faults
        enabled, huge = _thp(pid)
        assert enabled in (None, "0") and huge == 0, (enabled, huge)
        env = (Path(f"/proc/{pid}/environ").read_bytes()).split(b"\0")
        assert b"DSEC_THP_OFF=1" in env
    finally:
        await sb.stop()


async def test_ksm_and_cache_bound_off_are_honoured(plain_server):
    async with plain_server.client() as c:
        if "microvm" not in (await c.nodes())[0].backends:
            pytest.skip("the node offers no VM backends: guest kernel not fetched (dsec vm fetch-kernel)")
        sb = await c.create_microvm(image="busybox", memory_mb=MEMORY_MB)
        try:
            assert (await sb.run("true")).exit_code == 0
            pid, argv = _pid(plain_server, sb.id), _argv(plain_server, sb.id)
            assert "mem-merge=off" in argv[argv.index("-machine") + 1]
            assert "mg" not in _guest_ram_flags(pid)
            assert _merge_any(pid) in (None, "no")
            assert argv[argv.index("-accel") + 1] in ("tcg", "kvm")      # QEMU's default cache
            env = (Path(f"/proc/{pid}/environ").read_bytes()).split(b"\0")
            assert b"DSEC_KSM_ALL=1" not in env
            assert b"DSEC_THP_OFF=1" not in env and _thp(pid)[0] in (None, "1")    # DSEC_VM_QEMU_THP=1
            assert "-initrd" in argv and Path(argv[argv.index("-kernel") + 1]).stat().st_size > 1 << 20
        finally:
            await sb.stop()


async def test_a_clone_reads_no_kernel_or_initramfs(vm_client, server):
    """D96: a clone's QEMU gets the kernel's setup header as -kernel and no -initrd (QEMU reads
    both whole into fresh memory at start; the restored guest never reads them), and its guest
    runs as before: a command, and a file written and read back through its disk. The default
    again since D100 (DSEC_VM_RESTORE_STUB_KERNEL=1; the plain node above turns it off)."""
    sb = await vm_client.create_microvm(image="busybox", memory_mb=MEMORY_MB)
    try:
        argv = _argv(server, sb.id)
        assert "-initrd" not in argv
        kernel = Path(argv[argv.index("-kernel") + 1])
        assert kernel.stat().st_size < 64 << 10, kernel      # the real bzImage is ~8 MiB
        assert kernel.read_bytes()[0x202:0x206] == b"HdrS"
        r = await sb.run("echo hi > /tmp/x && cat /tmp/x && uname -r")
        assert r.exit_code == 0 and r.stdout.startswith("hi\n"), r
        # a second clone: the stub is made once per kernel file and shared
        twin = await vm_client.create_microvm(image="busybox", memory_mb=MEMORY_MB)
        try:
            assert (await twin.run("true")).exit_code == 0
            assert "-initrd" not in _argv(server, twin.id)
        finally:
            await twin.stop()
    finally:
        await sb.stop()


async def test_clones_from_the_kept_overlay_have_disks_of_their_own(vm_client, server):
    """The second and later clones of a template copy the overlay kept beside it: what one
    clone writes is in its own copy only (the kept one and the next clone see none of it)."""
    a = await vm_client.create_microvm(image="busybox", memory_mb=MEMORY_MB)
    b = None
    try:
        assert (await a.run("echo secret > /work/mine && sync")).exit_code == 0
        protos = list(server.paths.vm_templates.glob("*/overlay-*.qcow2"))
        assert protos, "no overlay kept beside the template"
        before = {p: p.read_bytes() for p in protos}
        b = await vm_client.create_microvm(image="busybox", memory_mb=MEMORY_MB)
        r = await b.run("cat /work/mine")
        assert r.exit_code != 0 and "secret" not in r.stdout
        assert {p: p.read_bytes() for p in protos if p.exists()} == {p: v for p, v in before.items() if p.exists()}
    finally:
        await a.stop()
        if b is not None:
            await b.stop()


def _local_timer_irqs(proc_interrupts: str) -> int:
    return sum(int(x) for ln in proc_interrupts.splitlines() if ln.strip().startswith("LOC:")
               for x in ln.split()[1:] if x.isdigit())


async def test_an_idle_clone_keeps_the_tsc_and_goes_tickless(vm_client, server):
    """Under TCG the guest's clocksource watchdog used to find the TSC "skewed" against late
    jiffies and fall back to refined-jiffies: a periodic 250 Hz tick in every idle clone (and
    ~1% of a host core per idle QEMU). The clone's guest keeps the TSC and, asleep, takes only
    the timer interrupts of timers that are due."""
    sb = await vm_client.create_microvm(image="busybox", memory_mb=MEMORY_MB)
    try:
        if sb.info.accel != "tcg":
            pytest.skip("only microvm under TCG is given the TSC frequency and tsc=reliable")
        # the template the clone restores was booted with it (the watchdog's verdict depends on
        # the host's load at that boot: on a quiet or busy box alike it mostly fell back)
        assert "tsc=reliable" in (await sb.run("cat /proc/cmdline")).stdout.split()
        cs = await sb.run("cat /sys/devices/system/clocksource/clocksource0/current_clocksource")
        # tsc-early until the guest's refinement work registers tsc (a restore may come before it):
        # both are continuous and, unverified under tsc=reliable, valid for a tickless idle
        assert cs.stdout.strip() in ("tsc", "tsc-early"), cs
        # one command: a 3 s guest sleep between two reads (a periodic tick: ~750 interrupts)
        r = await sb.run("cat /proc/interrupts; echo ==; sleep 3; cat /proc/interrupts")
        before, _, after = r.stdout.partition("==")
        assert _local_timer_irqs(after) - _local_timer_irqs(before) < 250, r.stdout
    finally:
        await sb.stop()
