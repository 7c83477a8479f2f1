"""One QEMU process: its command line as data, launching it detached, and its QMP channel.

The command line is built from a `Machine` (the VM's declarative description, like a
container's config.json) so tests can assert on it and a Firecracker driver could realise the
same description differently. QEMU runs daemonized with a pidfile, in its own session: an edge
restart leaves every VM running, and the restarted edge finds them through their directories.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from qemu.qmp import QMPClient

from dsec import procstat
from dsec.backends.vm import ramshim
from dsec.types import InvalidArgument, SandboxFailed, Unavailable

log = logging.getLogger("dsec.backends.vm")

QEMU = "qemu-system-x86_64"
Kind = Literal["microvm", "vm"]


def qemu_binary() -> str:
    path = shutil.which(QEMU)
    if path is None:
        raise Unavailable("the microvm/vm backends need QEMU, which is not installed on this node",
                          field="backend", fix="apt-get install qemu-system-x86 qemu-utils (scripts/install-extras.sh vm does)")
    return path


@dataclass(frozen=True)
class Disk:
    path: Path
    serial: str                 # how the guest tells disks apart (/sys/block/vdX/serial)
    readonly: bool = True
    fmt: Literal["raw", "qcow2"] = "raw"


@dataclass(frozen=True)
class Pmem:
    path: Path                  # file mapped into the guest (padded to the pmem alignment)
    size: int


@dataclass(frozen=True)
class Machine:
    """Everything that decides a VM's QEMU command line."""

    name: str
    kind: Kind
    accel: Literal["kvm", "tcg"]
    vcpus: int
    memory_mb: int
    kernel: Path
    initrd: Path | None               # None: a full-VM disk whose image brings no initrd
    append: str
    disks: tuple[Disk, ...]
    pmems: tuple[Pmem, ...] = ()
    ram_file: Path | None = None      # guest RAM in a file (templates: shared; clones: private)
    ram_shared: bool = False
    # a clone's QEMU preloads this (ramshim.py): its private mapping of the template's RAM file
    # is opened read-only and balloon discards never punch holes into the shared file
    ram_shim: Path | None = None
    agent_socket: Path = Path("agent.sock")
    qmp_socket: Path = Path("qmp.sock")
    console_log: Path = Path("console.log")
    # the serial console as a pipe (FIFOs <console_pipe>.in/.out) the edge reads into
    # console_log with a size cap (console.py); None: QEMU appends to console_log, unbounded
    console_pipe: Path | None = None
    pidfile: Path = Path("qemu.pid")
    incoming: bool = False            # wait for `migrate-incoming` (restore from a snapshot)
    # a NIC on QEMU's user-mode network (slirp): the guest's connections become sockets of
    # this QEMU, which runs in a network namespace of its own (launch) that the node plugs
    # into its bridge and governs like a container's (backends/vm/network.py)
    net: bool = False
    # started as a member of this cgroup (v2 dir): every socket QEMU ever makes is the
    # sandbox's, under the policy programs attached there before the guest runs
    cgroup: Path | None = None
    # TCG translation cache in MiB (`-accel tcg,tb-size=`); 0: QEMU's default (1 GiB of address
    # space, touched as code is translated, in 2 MiB huge pages). Ignored under KVM.
    tb_size_mb: int = 0
    # guest RAM madvise(MADV_MERGEABLE) (`-machine mem-merge=`): KSM may merge identical pages
    # of different VMs (and opens a timing side channel between them: docs/security.md)
    mem_merge: bool = False
    # every private page of this QEMU mergeable (prctl PR_SET_MEMORY_MERGE from the preloaded
    # shim), not only guest RAM; needs `shim`
    merge_all: bool = False
    shim: Path | None = None          # the preloaded shim (ramshim.c) for merge_all and thp_off
    # no transparent huge pages in this QEMU (prctl PR_SET_THP_DISABLE from the shim): QEMU
    # madvises its TCG code cache for them, and each 2 MiB fault costs ~11 ms of CPU on a
    # node whose own host takes back freed memory (D94); needs `shim`
    thp_off: bool = False

    def _dev(self, name: str) -> str:
        # microvm has no PCI: virtio devices sit on virtio-mmio ("-device" suffix)
        return f"{name}-device" if self.kind == "microvm" else f"{name}-pci"

    def argv(self, qemu: str = QEMU) -> list[str]:
        machine = ("microvm,pit=off,pic=off,rtc=on,isa-serial=on" if self.kind == "microvm"
                   else "q35,vmport=off,smm=off")
        mem = f"{self.memory_mb}M"
        if self.pmems:   # pmem devices are memory devices: they need hotplug slots and room
            extra_mb = sum((p.size + (1 << 20) - 1) >> 20 for p in self.pmems)
            mem += f",slots={len(self.pmems)},maxmem={self.memory_mb + extra_mb}M"
        a = [qemu, "-name", f"dsec-{self.name},debug-threads=off",
             "-machine", f"{machine},memory-backend=ram,mem-merge={'on' if self.mem_merge else 'off'}",
             "-accel", self.accel + (f",tb-size={self.tb_size_mb}" if self.accel == "tcg" and self.tb_size_mb else ""),
             "-cpu", "max" if self.accel == "tcg" else "host",
             "-smp", str(self.vcpus), "-m", mem,
             "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
             "-kernel", str(self.kernel), *(["-initrd", str(self.initrd)] if self.initrd else []),
             "-append", self.append,
             "-chardev", (f"pipe,id=con,path={self.console_pipe}" if self.console_pipe is not None
                          else f"file,id=con,path={self.console_log},append=on"),
             "-serial", "chardev:con",
             "-device", self._dev("virtio-serial"),
             "-chardev", f"socket,id=agent,path={self.agent_socket},server=on,wait=off",
             "-device", "virtserialport,chardev=agent,name=dsec.agent",
             # freed guest pages go back to the host (reporting, from the guest's buddy
             # allocator); a host-set balloon target gives way when the guest would OOM
             "-device", self._dev("virtio-balloon") + ",free-page-reporting=on,deflate-on-oom=on",
             "-qmp", f"unix:{self.qmp_socket},server=on,wait=off",
             "-pidfile", str(self.pidfile)]
        if self.ram_file is not None:
            a += ["-object", f"memory-backend-file,id=ram,size={self.memory_mb}M,mem-path={self.ram_file},"
                             f"share={'on' if self.ram_shared else 'off'}"]
        else:
            a += ["-object", f"memory-backend-ram,id=ram,size={self.memory_mb}M"]
        for i, d in enumerate(self.disks):
            ro = ",readonly=on" if d.readonly else ""
            cache = "" if d.readonly else ",cache=writeback,discard=unmap"
            a += ["-drive", f"if=none,id=d{i},file={d.path},format={d.fmt}{ro}{cache}",
                  "-device", f"{self._dev('virtio-blk')},drive=d{i},serial={d.serial}"]
        for i, p in enumerate(self.pmems):
            a += ["-object", f"memory-backend-file,id=pm{i},mem-path={p.path},size={p.size},share=off,readonly=on",
                  "-device", f"virtio-pmem-pci,memdev=pm{i},id=pmem{i}"]
        if self.net:   # no IPv6, no host forwards; the guest's address is slirp's (10.0.2.15)
            a += ["-netdev", "user,id=net0,ipv6=off",
                  "-device", self._dev("virtio-net") + ",netdev=net0" + ("" if self.kind == "microvm" else ",romfile=")]
        if self.incoming:
            a += ["-incoming", "defer"]
        return a

    def env(self) -> dict[str, str]:
        """Environment QEMU needs beyond the edge's own."""
        env: dict[str, str] = {}
        if self.ram_shim is not None and self.ram_file is not None and not self.ram_shared:
            env = ramshim.env(self.ram_shim, self.ram_file)
        if self.merge_all and self.shim is not None:
            env = {**env, "LD_PRELOAD": str(self.shim), ramshim.KSM_ALL: "1"}
        if self.thp_off and self.shim is not None:
            env = {**env, "LD_PRELOAD": str(self.shim), ramshim.THP_OFF: "1"}
        return env


async def launch(m: Machine, workdir: Path) -> int:
    """Start QEMU in its own session, detached from the edge (`setsid --fork`: an edge restart
    leaves the VM running and no zombie behind), with its stderr in `qemu.log`. Returns its pid
    once QMP is listening. QEMU's own error message is in the exception if it exits early."""
    argv = m.argv(qemu_binary())
    (workdir / "qemu.argv").write_text("\0".join(argv))
    if m.net:   # its own, empty network namespace: nothing leaves until the node plugs it in
        argv = ["unshare", "--net", *argv]
    if m.cgroup is not None:   # joined before exec: no socket of QEMU's ever outside it
        argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(m.cgroup / "cgroup.procs"), *argv]
    log_path = workdir / "qemu.log"
    with open(log_path, "ab") as logf:
        proc = await asyncio.create_subprocess_exec(
            "setsid", "--fork", *argv, cwd=workdir, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf,
            env={**os.environ, **m.env()} if m.env() else None)
        await proc.wait()
    deadline = time.monotonic() + 20.0
    started = time.monotonic()
    while True:
        try:
            pid = int(m.pidfile.read_text())
        except (OSError, ValueError):
            pid = None
        if pid is not None and m.qmp_socket.exists():
            return pid
        failed = (pid is not None and not pid_alive(pid, m.name)) or (
            pid is None and time.monotonic() - started > 0.5 and log_path.stat().st_size > 0)
        if failed or time.monotonic() > deadline:
            msg = qemu_log_tail(workdir) or "no output"
            raise SandboxFailed(f"QEMU could not start VM {m.name}: {msg}",
                                fix="check the guest kernel/initramfs (dsec vm fetch-kernel) and the VM arguments")
        await asyncio.sleep(0.002)


def qemu_log_tail(workdir: Path, n: int = 1500) -> str:
    try:
        return (workdir / "qemu.log").read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return ""


def shell_safe(p: Path) -> Path:
    """`p`, checked for use in QEMU's `exec:` migration URIs (run by /bin/sh, unquoted)."""
    if any(c in str(p) for c in " '\"\\$`;&|<>"):
        raise InvalidArgument(f"path {str(p)!r} has shell metacharacters", field="DSEC_HOME",
                              fix="use a DSEC_HOME without spaces or quotes")
    return p


def pid_alive(pid: int, name: str) -> bool:
    """True if `pid` is a live (non-zombie) QEMU of VM `name`: pids are reused."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = procstat.fields(pid)[0]
    except OSError:
        return False
    return f"dsec-{name},".encode() in cmdline and state not in ("Z", "X")


async def kill(pid: int, name: str, timeout_s: float = 5.0) -> None:
    """SIGKILL a VM's QEMU and wait until it is gone (its memory is then free)."""
    if not pid_alive(pid, name):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid, name) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


def pss_bytes(pid: int) -> int | None:
    """Proportional set size of a process: its private pages plus its share of shared ones."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Qmp:
    """A short-lived QMP connection (qemu.qmp, the QEMU project's own async client)."""

    def __init__(self, socket_path: Path, name: str):
        self.path = socket_path
        self.client = QMPClient(f"dsec-{name}")

    async def __aenter__(self) -> "Qmp":
        deadline = time.monotonic() + 10.0
        while True:
            try:
                await self.client.connect(str(self.path))
                return self
            except Exception as e:   # the socket appears a moment after QEMU daemonizes
                if time.monotonic() > deadline:
                    raise SandboxFailed(f"no QMP connection to {self.path}: {e}") from e
                self.client = QMPClient(self.client.name)
                await asyncio.sleep(0.01)

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.client.disconnect()
        except (EOFError, OSError):   # QEMU already closed its end (after `quit`, or it died)
            pass

    async def run(self, cmd: str, **args: Any) -> Any:
        return await self.client.execute(cmd, args or None)

    async def save_state(self, path: Path) -> None:
        """Write the paused VM's whole state, RAM included, to `path`. (A clone still has
        x-ignore-shared on from its own restore; the restoring side must see it off.) The
        default bandwidth cap (128 MiB/s) is for networks, not a local file."""
        await self.run("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": False}])
        await self.run("migrate-set-parameters", **{"max-bandwidth": 64 << 30})
        await self.run("migrate", uri=f"exec:cat > {shell_safe(path)}")
        await self.wait_migration()

    async def incoming_file(self, path: Path) -> None:
        """Start an incoming migration from a local file: its fd is handed to QEMU over QMP
        (`getfd`, then `fd:`), where `exec:cat` forked a shell and cat per restore."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.client.send_fd_scm(fd)
            await self.run("getfd", fdname="incoming")
        finally:
            os.close(fd)           # QEMU holds its own copy now
        await self.run("migrate-incoming", uri="fd:incoming")

    async def wait_migration(self, timeout_s: float = 120.0) -> None:
        """Poll an outgoing or incoming migration until it completes."""
        deadline = time.monotonic() + timeout_s
        delay = 0.002
        while True:
            st = await self.run("query-migrate")
            status = st.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise SandboxFailed(f"VM snapshot transfer {status}: {st.get('error-desc', 'no detail')}")
            if time.monotonic() > deadline:
                raise SandboxFailed(f"VM snapshot transfer did not finish in {timeout_s:.0f}s (status {status})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def wait_running(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        delay = 0.002
        while True:
            st = await self.run("query-status")
            if st.get("status") == "running":
                return
            if st.get("status") in ("paused", "postmigrate", "prelaunch"):
                # the stream carries the source's run state: snapshots are taken paused
                await self.run("cont")
                continue
            if st.get("status") in ("internal-error", "guest-panicked", "shutdown"):
                raise SandboxFailed(f"VM is {st.get('status')} after restore")
            if time.monotonic() > deadline:
                raise SandboxFailed(f"VM did not start running in {timeout_s:.0f}s after restore "
                                    f"(status {st.get('status')})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
