"""The guest side of the microVM / full-VM backends: kernel, initramfs, writable disk, boot contract.

Nothing here is installed on the host: the kernel is Debian's linux-image-cloud-amd64 unpacked
under DSEC_HOME, the initramfs is built by this module and cached by content hash.

Boot contract (the QEMU driver depends on it exactly)
=====================================================
Kernel and initrd: `ensure_kernel(paths).vmlinuz`, `build_initramfs(paths, kernel)` (uncompressed
newc cpio: TCG decompresses slowly). The initramfs /init (init.sh next to this file) builds the
root and then exec's (switch_root) the dsec agent as PID 1 of the guest.

Disks (virtio-blk: `virtio-blk-device` on microvm, `virtio-blk-pci` on q35), found by serial in
/sys/block/vd*/serial, so attach order does not matter:
  - `dsec-l0` ... `dsec-l{N-1}`: the image's read-only EROFS layer files, l0 = base (bottom),
    l{N-1} = top; attach with readonly=on (one file can back every VM on the node).
  - `dsec-upper`: the writable disk, a raw ext4 image made by `make_upper_disk()` on the host.
    init mounts it and uses upper/ and work/ inside it (created when missing), so an upper disk
    from a stopped VM (or a template) can be reattached as is.
With `dsec.pmem=1` (q35 only: virtio-pmem does not work on microvm in QEMU 7.2) the layers are
instead virtio-pmem devices /dev/pmem0 .. /dev/pmem{N-1}, attached in layer order (pmem0 = base),
mounted `-t erofs -o ro,dax`; the upper disk stays virtio-blk `dsec-upper`.

Root: overlay lowerdir=l{N-1}:...:l0, upperdir/workdir on dsec-upper. The agent binary sits on
a read-only tmpfs at /.dsec/agent (outside the writable tree); /proc, /sys, devtmpfs /dev,
/dev/pts (newinstance), /dev/shm are mounted; lo is up; hostname from dsec.hostname.

Kernel command line (`kernel_cmdline()` builds it):
  console=ttyS0 quiet panic=-1      console on the 16550 (q35, and microvm with isa-serial=on);
                                    panic=-1 + QEMU -no-reboot: a dead init stops the VM
  tsc_early_khz=<host kHz>          microvm under TCG: without it ~25% of boots hang
  tsc=reliable                      (with it) the TSC stays the clocksource: a tickless idle guest
  dsec.layers=N                     number of layers (>= 1)                        (required)
  dsec.pmem=0|1                     layers on /dev/pmemI with DAX instead of virtio-blk (default 0)
  dsec.workdir=/path                agent -w (default /; no spaces)
  dsec.uid=U dsec.gid=G             agent -u/-g: default user of commands and file ops (default 0)
  dsec.nofile=N                     agent -n: RLIMIT_NOFILE of commands (default 4096)
  dsec.fsize=BYTES                  agent -F: RLIMIT_FSIZE of commands (default 0 = none)
  dsec.hostname=NAME                guest hostname (default "sandbox")
  dsec.wait_ms=MS                   how long init waits for devices (default 20000)
  dsec.dns=IP                       the guest has a NIC (virtio-net, QEMU user-mode network):
                                    eth0 10.0.2.15/24 via 10.0.2.2, /etc/resolv.conf (a read-only
                                    bind from /.dsec) names IP; absent: no network configured

Agent channel: virtio-serial port named `dsec.agent`:
  microvm: -device virtio-serial-device     q35: -device virtio-serial-pci
  -chardev socket,id=agent,path=SOCK,server=on,wait=off
  -device virtserialport,chardev=agent,name=dsec.agent
The agent runs `-D /dev/vportNpM` (docs/agent-protocol.md, "Device mode"); the edge connects to
SOCK with `AgentClient.connect(SOCK)` and speaks the unchanged protocol. One host connection at
a time; after a host disconnect (or a snapshot restore) the next connection is a fresh one
(re-ATTACH to get retained output). The agent answers nothing until the host sends a frame.

Console: ttyS0 (`-serial chardev:con`), on both machines; the driver's chardev is a pipe the
edge reads into a size-capped log (console.py), `qemu_argv` below appends to a file.
init failures print `dsec-init: error: ...` there before the kernel panics.

`qemu_argv(GuestBoot(...)) -> list[str]` is the full, foreground QEMU command line the tests
boot with; the driver's `qemu.Machine.argv()` realises the same contract (daemonized, QMP).

Functions: ensure_kernel(paths) -> KernelFiles; build_initramfs(paths, kernel, agent=None) -> Path;
make_upper_disk(path, size_mb) -> None; kernel_cmdline(...) -> str; qemu_argv(GuestBoot) -> list[str];
pmem_image(layer, cache_dir) -> Path (layer padded to 2 MiB for virtio-pmem);
resolve_modules(modules_dir, names) -> list[tuple[str, Path]].
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Sequence

from dsec.config import Paths
from dsec.insandbox import source

log = logging.getLogger("dsec.backends.vm")

KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
INIT_SCRIPT = source("vm-init.sh")
BUSYBOX = Path("/bin/busybox")  # Debian busybox-static
# applets init.sh uses, linked into /bin (busybox sh finds them through PATH)
APPLETS = ("sh", "mount", "umount", "mkdir", "cat", "cp", "ln", "insmod", "usleep", "test", "[",
           "switch_root", "hostname", "ifconfig", "route", "echo", "sleep", "ls", "dmesg")
# (group, module): "core" always loads; "pci" only when the guest has PCI (q35, not microvm);
# "pmem" only with dsec.pmem=1, "net" only with dsec.dns= (a NIC). Builtins are skipped. Each
# insmod costs ~10 ms under TCG.
GUEST_MODULE_GROUPS = ("core", "pci", "pmem", "net")
GUEST_MODULES: tuple[tuple[str, str], ...] = (
    ("core", "virtio_mmio"), ("pci", "virtio_pci"), ("core", "virtio_blk"),
    ("core", "virtio_console"), ("core", "virtio_balloon"), ("core", "erofs"),
    ("core", "overlay"), ("core", "ext4"),
    ("pmem", "virtio_pmem"), ("pmem", "nd_pmem"), ("pmem", "dax"),
    ("net", "virtio_net"),
)


class GuestError(RuntimeError):
    pass


@dataclass(frozen=True)
class KernelFiles:
    vmlinuz: Path
    modules: Path       # .../lib/modules/<version>
    version: str        # e.g. 6.1.0-57-cloud-amd64


# ---------------------------------------------------------------------------- kernel

def _run(argv: Sequence[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise GuestError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def kernel_package(meta: str = KERNEL_META_PACKAGE) -> str:
    """The versioned linux-image-* package the meta package depends on (from the apt lists)."""
    try:
        out = _run(["apt-cache", "depends", meta])
    except (GuestError, FileNotFoundError) as e:
        raise GuestError(f"cannot resolve {meta}: {e}; run apt-get update first") from e
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends:") and "linux-image-" in line:
            return line.split(":", 1)[1].strip()
    raise GuestError(f"{meta} has no linux-image-* dependency in the apt lists (apt-get update?)")


def _kernel_files(root: Path, version: str) -> KernelFiles:
    return KernelFiles(root / "boot" / f"vmlinuz-{version}", root / "lib" / "modules" / version, version)


def installed_kernel(paths: Paths) -> KernelFiles | None:
    """The newest kernel already fetched into DSEC_HOME (no apt access), or None."""
    base = paths.vm / "kernel"
    done = sorted(p.parent for p in base.glob("*/.complete")) if base.is_dir() else []
    return _kernel_files(done[-1], done[-1].name) if done else None


def ensure_kernel(paths: Paths, meta: str = KERNEL_META_PACKAGE) -> KernelFiles:
    """Download (apt-get download) and unpack (dpkg-deb -x) the guest kernel into
    <DSEC_HOME>/vm/kernel/<version>/; idempotent, safe against concurrent callers."""
    from dsec.images.store import FileLock

    package = kernel_package(meta)
    version = package.removeprefix("linux-image-")
    base = paths.vm / "kernel"
    target = base / version
    if (target / ".complete").exists():
        return _kernel_files(target, version)
    base.mkdir(parents=True, exist_ok=True)
    with FileLock(base / ".lock"):
        if (target / ".complete").exists():
            return _kernel_files(target, version)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=base) as tmp:
            t = Path(tmp)
            # root downloads into a root-owned dir: the _apt sandbox user could not write there
            _run(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package], cwd=t)
            debs = sorted(t.glob("*.deb"))
            if not debs:
                raise GuestError(f"apt-get download {package} produced no .deb")
            _run(["dpkg-deb", "-x", str(debs[0]), str(t / "root")])
            files = _kernel_files(t / "root", version)
            if not files.vmlinuz.is_file() or not files.modules.is_dir():
                raise GuestError(f"{debs[0].name} has no boot/vmlinuz-{version} or lib/modules/{version}")
            # only what a guest needs: the kernel, its config and the modules
            shutil.rmtree(t / "root" / "usr", ignore_errors=True)
            (t / "root" / ".complete").write_text(package + "\n")
            if target.exists():          # a half-finished earlier attempt
                shutil.rmtree(target)
            os.rename(t / "root", target)
    log.info("guest kernel %s unpacked into %s", version, target)
    return _kernel_files(target, version)


# ---------------------------------------------------------------------------- modules

def _modinfo(ko: Path) -> dict[str, str]:
    """key=value strings of a module's .modinfo ELF section (what modinfo(8) prints); the
    package ships no modules.dep and the host may have no kmod, so we read the ELF ourselves."""
    data = ko.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise GuestError(f"{ko}: not an ELF64 module (compressed modules are not supported)")
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def sh(i: int) -> tuple[int, int, int]:   # name offset, file offset, size
        off = e_shoff + i * e_shentsize
        name, = struct.unpack_from("<I", data, off)
        offset, size = struct.unpack_from("<QQ", data, off + 0x18)
        return name, offset, size

    _, str_off, _ = sh(e_shstrndx)
    for i in range(e_shnum):
        name, offset, size = sh(i)
        end = data.index(b"\0", str_off + name)
        if data[str_off + name:end] == b".modinfo":
            info: dict[str, str] = {}
            for item in data[offset:offset + size].split(b"\0"):
                k, sep, v = item.partition(b"=")
                if sep:
                    info.setdefault(k.decode(), v.decode(errors="replace"))
            return info
    return {}


def _norm(name: str) -> str:
    return name.replace("-", "_")


def resolve_modules(modules_dir: Path, wanted: Iterable[str]) -> list[tuple[str, Path]]:
    """(name, path) of the wanted modules and their dependencies, dependencies first; modules
    built into the kernel (modules.builtin) are left out."""
    builtin = {_norm(Path(line.strip()).name.removesuffix(".ko"))
               for line in (modules_dir / "modules.builtin").read_text().splitlines() if line.strip()}
    index = {_norm(p.name.removesuffix(".ko")): p for p in (modules_dir / "kernel").rglob("*.ko")}
    order: list[tuple[str, Path]] = []
    seen: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        name = _norm(name)
        if name in seen or name in builtin:
            return
        if name in chain:
            raise GuestError(f"module dependency cycle: {' -> '.join(chain + (name,))}")
        if name not in index:
            raise GuestError(f"module {name} is neither built in nor in {modules_dir}")
        for dep in filter(None, _modinfo(index[name]).get("depends", "").split(",")):
            visit(dep, chain + (name,))
        seen.add(name)
        order.append((name, index[name]))

    for w in wanted:
        visit(w, ())
    return order


# ---------------------------------------------------------------------------- initramfs

class _Cpio:
    """Writer of the "newc" cpio format the kernel unpacks (no cpio(1) needed, no root needed
    for the /dev/console node)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        nm = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(nm), 0)
        self.ino += 1
        self.buf.write(b"070701" + b"".join(b"%08X" % f for f in fields) + nm)
        self.buf.write(b"\0" * (-(110 + len(nm)) % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * (-len(data) % 4))

    def dir(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, 0o100000 | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, 0o120777, target.encode())

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, 0o020600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        self.buf.write(b"\0" * (-self.buf.tell() % 512))
        return self.buf.getvalue()


def _initramfs_inputs(kernel: KernelFiles, agent: Path) -> tuple[list[tuple[str, str, Path]], str]:
    """The module list (group, name, path) and the content hash of everything in the image."""
    mods: list[tuple[str, str, Path]] = []
    have: set[str] = set()
    for group in GUEST_MODULE_GROUPS:
        wanted = [m for g, m in GUEST_MODULES if g == group]
        for name, path in resolve_modules(kernel.modules, wanted):
            if name not in have:
                have.add(name)
                mods.append((group, name, path))
    h = hashlib.sha256(b"dsec-initramfs-v1\0" + kernel.version.encode())
    for p in (INIT_SCRIPT, BUSYBOX, agent, *(m[2] for m in mods)):
        h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    h.update(repr([(g, n) for g, n, _ in mods]).encode())
    return mods, h.hexdigest()[:16]


def build_initramfs(paths: Paths, kernel: KernelFiles, agent: Path | None = None) -> Path:
    """<DSEC_HOME>/vm/initramfs/initramfs-<hash>.cpio with busybox, the modules, the agent and
    /init; rebuilt only when one of those changes. Uncompressed: under TCG the kernel's
    decompressor costs more than reading a few MiB more."""
    if agent is None:
        from dsec.agent.build import agent_binary
        agent = agent_binary(paths.bin)
    if not BUSYBOX.is_file():
        raise GuestError(f"{BUSYBOX} is missing: apt-get install busybox-static")
    mods, digest = _initramfs_inputs(kernel, agent)
    out_dir = paths.vm / "initramfs"
    target = out_dir / f"initramfs-{digest}.cpio"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    c = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "etc", "etc/dsec", "lib", "lib/modules", "dsec"):
        c.dir(d)
    c.chardev("dev/console", 5, 1)   # the kernel opens it for init's stdio before /init runs
    c.chardev("dev/null", 1, 3)
    c.file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
    for applet in APPLETS:
        c.symlink(f"bin/{applet}", "busybox")
    c.file("init", INIT_SCRIPT.read_bytes(), 0o755)
    c.file("dsec/agent", agent.read_bytes(), 0o755)
    for _, name, path in mods:
        c.file(f"lib/modules/{name}.ko", path.read_bytes())
    c.file("etc/dsec/modules", "".join(f"{g} {n}.ko\n" for g, n, _ in mods).encode())
    fd, tmp = tempfile.mkstemp(prefix=".initramfs-", dir=out_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(c.finish())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)      # atomic: concurrent builders write identical bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s (%d modules)", target, len(mods))
    return target


# ---------------------------------------------------------------------------- disks, cmdline

def make_upper_disk(path: Path, size_mb: int) -> None:
    """A sparse raw ext4 image for `dsec-upper` (host-side mkfs: the guest has no mkfs)."""
    path = Path(path)
    with open(path, "wb") as f:
        f.truncate(size_mb << 20)
    # -m 0: no root reserve (the sandbox is root anyway); lazy init keeps the file sparse
    _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1",
          str(path)])


def host_tsc_khz() -> int | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


# With tsc_early_khz (microvm under TCG): no clocksource watchdog on the TSC. Without it the
# watchdog's reference there (jiffies: timer ticks a busy host delivers late) finds the TSC
# "skewed" within seconds of boot, the guest falls back to refined-jiffies, which cannot run
# tickless, and a periodic 250 Hz tick wakes every idle guest and its QEMU: ~1% of a host core
# per idle clone (D85). TCG's TSC follows the host's monotonic clock, so it is the better clock.
# Part of a template's key (driver.guest_identity): a template booted without it keeps ticking.
TCG_CLOCK_ARGS = ("tsc=reliable",)


def kernel_cmdline(*, layers: int, pmem: bool = False, workdir: str = "/", uid: int = 0,
                   gid: int = 0, nofile: int = 4096, fsize: int = 0, hostname: str = "sandbox",
                   tsc_khz: int | None = None, extra: Sequence[str] = ()) -> str:
    """The guest kernel command line of the boot contract (see the module docstring)."""
    if layers < 1:
        raise ValueError("a guest root needs at least one layer")
    for v in (workdir, hostname):
        if not v or any(ch.isspace() for ch in v):
            raise ValueError(f"{v!r}: kernel command line values cannot be empty or hold spaces")
    parts = ["console=ttyS0", "quiet", "panic=-1"]
    if tsc_khz:
        parts += [f"tsc_early_khz={tsc_khz}", *TCG_CLOCK_ARGS]
    parts += [f"dsec.layers={layers}", f"dsec.pmem={int(pmem)}", f"dsec.workdir={workdir}",
              f"dsec.uid={uid}", f"dsec.gid={gid}", f"dsec.nofile={nofile}", f"dsec.fsize={fsize}",
              f"dsec.hostname={hostname}", *extra]
    return " ".join(parts)


PMEM_ALIGN = 2 << 20   # virtio-pmem memory regions are mapped in 2 MiB blocks


def pmem_image(layer: Path, cache_dir: Path) -> Path:
    """`layer` itself when its size is a PMEM_ALIGN multiple, else a zero-padded copy in
    cache_dir (QEMU maps a memory-backend-file only at its exact size, and store files are
    content-addressed, so they are not padded in place). EROFS ignores the padding."""
    size = layer.stat().st_size
    if size % PMEM_ALIGN == 0:
        return layer
    target = cache_dir / f"{layer.stem}.pmem{layer.suffix}"
    if target.is_file() and target.stat().st_size == -(-size // PMEM_ALIGN) * PMEM_ALIGN:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pmem-", dir=cache_dir)
    os.close(fd)
    try:
        # a reflink where the filesystem has them, else a plain copy
        _run(["cp", "--reflink=auto", str(layer), tmp])
        os.truncate(tmp, -(-size // PMEM_ALIGN) * PMEM_ALIGN)
        os.chmod(tmp, 0o444)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@dataclass
class GuestBoot:
    """What a foreground test/debug boot needs; the driver's qemu.Machine is the daemonized twin."""

    machine: Literal["microvm", "q35"]
    kernel: KernelFiles
    initramfs: Path
    layers: Sequence[Path]            # base first
    upper: Path
    agent_socket: Path
    console_log: Path
    accel: Literal["kvm", "tcg"] = "tcg"
    memory_mb: int = 512
    vcpus: int = 1
    pmem: bool = False                # q35 only; layer files must be PMEM_ALIGN multiples (pmem_image)
    workdir: str = "/"
    uid: int = 0
    gid: int = 0
    nofile: int = 4096
    qmp_socket: Path | None = None
    extra_cmdline: Sequence[str] = field(default_factory=tuple)


def qemu_argv(b: GuestBoot, qemu: str = "qemu-system-x86_64") -> list[str]:
    """The QEMU command line of the boot contract (foreground, no daemonize)."""
    if b.pmem and b.machine != "q35":
        raise ValueError("virtio-pmem layers need the q35 machine (not microvm in QEMU 7.2)")
    dev = (lambda n: f"{n}-device") if b.machine == "microvm" else (lambda n: f"{n}-pci")
    machine = ("microvm,pit=off,pic=off,rtc=on,isa-serial=on" if b.machine == "microvm"
               else "q35,vmport=off,smm=off")
    tsc = host_tsc_khz() if b.machine == "microvm" and b.accel == "tcg" else None
    mem = f"{b.memory_mb}M"
    if b.pmem:
        extra = sum(-(-p.stat().st_size // PMEM_ALIGN) * PMEM_ALIGN for p in b.layers) >> 20
        mem += f",slots={len(b.layers)},maxmem={b.memory_mb + extra}M"
    a = [qemu, "-machine", f"{machine},accel={b.accel}",
         "-cpu", "max" if b.accel == "tcg" else "host", "-smp", str(b.vcpus), "-m", mem,
         "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
         "-kernel", str(b.kernel.vmlinuz), "-initrd", str(b.initramfs),
         "-append", kernel_cmdline(layers=len(b.layers), pmem=b.pmem, workdir=b.workdir,
                                   uid=b.uid, gid=b.gid, nofile=b.nofile, tsc_khz=tsc,
                                   extra=b.extra_cmdline),
         "-chardev", f"file,id=con,path={b.console_log}", "-serial", "chardev:con",
         "-device", dev("virtio-serial"),
         "-chardev", f"socket,id=agent,path={b.agent_socket},server=on,wait=off",
         "-device", "virtserialport,chardev=agent,name=dsec.agent",
         "-device", dev("virtio-balloon") + ",free-page-reporting=on,deflate-on-oom=on"]
    if b.qmp_socket is not None:
        a += ["-qmp", f"unix:{b.qmp_socket},server=on,wait=off"]
    for i, layer in enumerate(b.layers):
        if b.pmem:
            size = -(-layer.stat().st_size // PMEM_ALIGN) * PMEM_ALIGN
            a += ["-object", f"memory-backend-file,id=pm{i},mem-path={layer},size={size},share=off,readonly=on",
                  "-device", f"virtio-pmem-pci,memdev=pm{i},id=pmem{i}"]
        else:
            a += ["-drive", f"if=none,id=l{i},file={layer},format=raw,readonly=on",
                  "-device", f"{dev('virtio-blk')},drive=l{i},serial=dsec-l{i}"]
    a += ["-drive", f"if=none,id=up,file={b.upper},format=raw,cache=writeback,discard=unmap",
          "-device", f"{dev('virtio-blk')},drive=up,serial=dsec-upper"]
    return a


def main(argv: Sequence[str] = ()) -> int:
    """`python -m dsec.backends.vm.guest [fetch-kernel|initramfs]`: the install step."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from dsec.settings import Settings
    paths = Settings.from_env().paths     # an entry point: its environment, read once
    k = ensure_kernel(paths)
    print(f"kernel {k.version}: {k.vmlinuz}")
    if "initramfs" in argv:
        print(f"initramfs: {build_initramfs(paths, k)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
