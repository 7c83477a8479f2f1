"""Console floods from inside a microVM. Guest root used to get port I/O (`iopl(3)`, then
`outb` to the 16550 at 0x3f8: Landlock on /dev/ttyS0 does not see port I/O) and QEMU appended
every byte to the host's console.log, ~1 MB/s without limit. Now the agent drops CAP_SYS_RAWIO
(and CAP_SYS_MODULE) from the bounding set of every command in a guest, and the edge reads the
console from QEMU's socket into a file it keeps under a hard cap (backends/vm/console.py).

The port-I/O helper is a static C program compiled here, on the host, and written into the
guest with the file API (the busybox image has no compiler)."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import subprocess
import time

import pytest

from dsec.backends.vm import console as vmconsole
from dsec.backends.vm import guest
from dsec.backends.vm.qemu import Machine, kill, launch, pid_alive

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"),
]

# iopl(3) and ioperm on the serial port; with an argument SECS (or as PID 1: forever) it
# then writes bytes straight to the port with outb, as fast as the guest can.
IOFLOOD_C = r"""
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <time.h>
#include <unistd.h>

static const char *res(int r, int e) { return r == 0 ? "ok" : e == EPERM ? "EPERM" : strerror(e); }

int main(int argc, char **argv)
{
	double secs = getpid() == 1 ? 1e9 : argc > 1 ? atof(argv[1]) : 0;
	int r1 = iopl(3), e1 = errno;
	int r2 = ioperm(0x3f8, 8, 1), e2 = errno;
	printf("iopl=%s ioperm=%s\n", res(r1, e1), res(r2, e2));
	fflush(stdout);
	if ((r1 == 0 || r2 == 0) && secs > 0) {
		struct timespec t0, t;
		unsigned long n = 0;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		do {
			for (int i = 0; i < 4096; i++)
				outb('A' + i % 26, 0x3f8);
			n += 4096;
			clock_gettime(CLOCK_MONOTONIC, &t);
		} while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < secs);
		printf("wrote=%lu\n", n);
	}
	return 0;
}
"""


@pytest.fixture(scope="module")
def ioflood(tmp_path_factory):
    cc = shutil.which("musl-gcc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on the host (apt-get install musl-tools) for the guest's port-I/O helper")
    d = tmp_path_factory.mktemp("ioflood")
    (d / "ioflood.c").write_text(IOFLOOD_C)
    r = subprocess.run([cc, "-static", "-O2", "-o", str(d / "ioflood"), str(d / "ioflood.c")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d / "ioflood"


async def test_guest_root_gets_no_port_io_and_console_log_stays_capped(vm_client, server, ioflood):
    """Root in a microVM: iopl(3) and ioperm(0x3f8) fail with EPERM (no CAP_SYS_RAWIO), writes
    to /dev/console and /dev/ttyS0 are refused (Landlock); after 4 s of trying to flood the
    serial port the host's console.log is under the cap, and the VM still serves."""
    sb = await vm_client.create_microvm(image="busybox", memory_mb=256, user="root")
    try:
        log = server.paths.vm_sandboxes / sb.id / "console.log"
        await sb.files.write("/work/ioflood", ioflood.read_bytes(), mode=0o755)
        t0 = time.monotonic()
        r = await sb.run("/work/ioflood 4", timeout_s=60)
        print(f"\nflood attempt: {r.stdout.strip()!r} in {time.monotonic() - t0:.1f}s, "
              f"console.log {log.stat().st_size if log.exists() else 0} bytes")
        assert "iopl=EPERM ioperm=EPERM" in r.stdout, r
        r = await sb.run("grep -E '^CapBnd' /proc/self/status; for dev in /dev/console /dev/ttyS0; do "
                         "timeout 2 sh -c \"yes > $dev\" && echo WROTE $dev; done; echo done", timeout_s=30)
        assert "WROTE" not in r.stdout and r.stdout.endswith("done\n"), r
        bnd = int(r.stdout.split()[1], 16)
        assert not bnd & (1 << 17) and not bnd & (1 << 16), f"CAP_SYS_RAWIO/SYS_MODULE in the bounding set: {r.stdout}"
        assert log.stat().st_size <= vmconsole.CONSOLE_MAX_BYTES, log.stat().st_size
        assert (await sb.run("echo alive")).stdout == "alive\n"
    finally:
        await sb.stop()


async def test_console_flood_of_a_privileged_guest_stays_under_the_cap(server, ioflood, tmp_path):
    """Whatever reaches the serial port (here a guest whose PID 1 floods it with outb, which
    nothing inside can stop): the host's console.log never passes the cap, the tap's reads
    are paced (the edge spends little CPU on it), and QEMU keeps running."""
    kernel = guest.installed_kernel(server.paths)
    if kernel is None:
        pytest.skip("guest kernel not fetched (dsec vm fetch-kernel)")
    cpio = guest._Cpio()
    cpio.dir("dev")
    cpio.chardev("dev/console", 5, 1)
    cpio.file("init", ioflood.read_bytes(), 0o755)
    initrd = tmp_path / "flood.cpio"
    initrd.write_bytes(cpio.finish())
    d = tmp_path / "vm"
    d.mkdir(mode=0o700)
    tsc = guest.host_tsc_khz()
    cap = 128 << 10
    m = Machine(name=f"cxflood-{os.urandom(3).hex()}", kind="microvm", accel="tcg", vcpus=1, memory_mb=128,
                kernel=kernel.vmlinuz, initrd=initrd,
                append="console=ttyS0 quiet panic=-1" + (f" tsc_early_khz={tsc}" if tsc else ""), disks=(),
                agent_socket=d / "agent.sock", qmp_socket=d / "qmp.sock", console_log=d / "console.log",
                console_pipe=vmconsole.make_fifos(d), pidfile=d / "qemu.pid")
    tap = vmconsole.attach(d, max_bytes=cap)
    assert tap is not None
    pid = await launch(m, d)
    try:
        # the guest boots under TCG first (seconds on a loaded host): measure once it floods
        boot_deadline = time.monotonic() + 120
        while tap.read_bytes < 64 << 10 and time.monotonic() < boot_deadline:
            await asyncio.sleep(0.1)
        ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        peak = 0
        while time.monotonic() - t0 < 8:
            peak = max(peak, (d / "console.log").stat().st_size if (d / "console.log").exists() else 0)
            await asyncio.sleep(0.05)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        print(f"\nread {tap.read_bytes} bytes of console in 8 s in {tap.wakeups} wakeups, console.log "
              f"peak {peak} bytes (cap {cap}), test process CPU {cpu:.2f}s")
        assert tap.read_bytes > 2 * cap, "the guest did not flood its console"
        assert peak <= cap and (d / "console.log").stat().st_size <= cap
        assert "ABCDEFGHIJ" in (d / "console.log").read_bytes().decode(errors="replace")
        assert tap.wakeups <= 8 / vmconsole.CONSOLE_PACE_S + 5, tap.wakeups
        assert cpu < 0.5, f"reading a flooded console took {cpu:.2f}s CPU in 8 s"
        assert pid_alive(pid, m.name)
    finally:
        await kill(pid, m.name)
        vmconsole.detach(d)
