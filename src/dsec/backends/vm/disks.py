"""Bootable full-VM disks: an image that brings its own kernel and init, as a qcow2.

`build(paths, name, image)` turns an image's layers into one ext4 filesystem, converted to qcow2:

  <home>/vm/disks/NAME.qcow2    the root filesystem (ext4 over the whole device, no partitions)
  <home>/vm/disks/NAME.vmlinuz  the image's own kernel (/boot/vmlinuz-<ver>), copied out
  <home>/vm/disks/NAME.initrd   the image's own initrd (/boot/initrd.img-<ver>), when it has one
  <home>/vm/disks/disks.json    registry: name -> image, digest, kernel version, size, build id

There is no bootloader in the disk: QEMU boots the image's kernel directly (`-kernel/-initrd`
with `root=/dev/vda rw console=ttyS0 panic=-1`), which is what a bootloader would do anyway and
keeps the build free of partition tables, grub and firmware (SeaBIOS would add seconds under TCG).

How the tree is made: the layers' EROFS files are mounted read-only and stacked with overlayfs
(same order as the edge: base at the bottom) inside a private mount namespace (`unshare -m`),
so nothing is ever visible in, or left behind in, the host's mount table, even if the build is
killed. The overlay gets a scratch upper dir, where the dsec additions are written:
  /.dsec/agent                              the guest agent (dsec.agent.build.agent_binary)
  /etc/systemd/system/dsec-agent.service    runs it with `-D /dev/virtio-ports/dsec.agent`
  .../multi-user.target.wants/dsec-agent.service (symlink: enabled)
  /etc/udev/rules.d/90-dsec-agent.rules     tags the port for systemd (a .device unit to wait on)
  /etc/fstab, /etc/hostname, masks for units that only slow a sandbox down
then `mkfs.ext4 -d MERGED` makes the filesystem (ownership, modes, xattrs, hard links kept) and
`qemu-img convert -O qcow2` compacts it. Each sandbox boots a qcow2 overlay over NAME.qcow2.

A rebuild or `rm` replaces/unlinks the files. Every VM booted from NAME.qcow2 holds its own hard
link to it (backends/vm/chain.py), so running and suspended VMs and their snapshots keep the disk
they were booted from. (The kernel is loaded at boot only: a resume reads RAM from its state.)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dsec.config import Paths
from dsec.images.store import FileLock
from dsec.types import InvalidArgument, NotFound, Unavailable

log = logging.getLogger("dsec.backends.vm")

DISK_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
AGENT_PORT = "/dev/virtio-ports/dsec.agent"
# Units that wait for things a sandbox VM never has (network, a first-boot dialogue on a
# console nobody types on) or do periodic maintenance nobody wants in a short-lived guest.
MASKED_UNITS = ("systemd-networkd-wait-online.service", "systemd-firstboot.service", "getty-static.service",
                "apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_reap.service",
                "e2scrub_all.timer", "fstrim.timer", "man-db.timer", "systemd-timesyncd.service",
                "getty@tty1.service")


@dataclass(frozen=True)
class DiskInfo:
    name: str
    image: str                  # the image name it was built from
    image_digest: str
    kernel_version: str
    size_mb: int                # the guest's filesystem size (fixed at build)
    build_id: str               # changes with every build
    created_at: float
    uid: int = 1000             # the agent's default user in the guest (-u/-g)
    gid: int = 1000
    workdir: str = "/work"
    has_initrd: bool = True

    def files(self, paths: Paths) -> "DiskFiles":
        d = disks_dir(paths)
        return DiskFiles(d / f"{self.name}.qcow2", d / f"{self.name}.vmlinuz",
                         d / f"{self.name}.initrd" if self.has_initrd else None)


@dataclass(frozen=True)
class DiskFiles:
    qcow2: Path
    kernel: Path
    initrd: Path | None


def disks_dir(paths: Paths) -> Path:
    return paths.vm / "disks"


def kernel_append() -> str:
    """The command line a bootloader would pass: root is the whole first virtio disk."""
    return "root=/dev/vda rw console=ttyS0 panic=-1"


# ------------------------------------------------------------------------------- registry

def _registry_path(paths: Paths) -> Path:
    return disks_dir(paths) / "disks.json"


def _load(paths: Paths) -> dict[str, DiskInfo]:
    try:
        raw = json.loads(_registry_path(paths).read_text())
    except FileNotFoundError:
        return {}
    return {k: DiskInfo(**v) for k, v in raw.items()}


def _save(paths: Paths, disks: dict[str, DiskInfo]) -> None:
    tmp = _registry_path(paths).with_suffix(".tmp")
    tmp.write_text(json.dumps({k: asdict(v) for k, v in sorted(disks.items())}, indent=1))
    os.replace(tmp, _registry_path(paths))


def list_disks(paths: Paths) -> list[DiskInfo]:
    return list(_load(paths).values())


def get(paths: Paths, name: str) -> DiskInfo:
    info = _load(paths).get(name)
    if info is None or not info.files(paths).qcow2.is_file():
        raise NotFound(f"no VM disk {name!r} on this node", field="disk",
                       fix=f"build it: `dsec vm disk build {name} --image IMAGE` (list: `dsec vm disk ls`)")
    return info


def remove(paths: Paths, name: str) -> None:
    d = disks_dir(paths)
    d.mkdir(parents=True, exist_ok=True)
    with FileLock(d / ".lock"):
        disks = _load(paths)
        info = disks.pop(name, None)
        if info is None:
            raise NotFound(f"no VM disk {name!r} on this node", field="name", fix="see `dsec vm disk ls`")
        for suffix in ("qcow2", "vmlinuz", "initrd"):
            (d / f"{name}.{suffix}").unlink(missing_ok=True)
        _save(paths, disks)


# ------------------------------------------------------------------------------- build

def _need(tool: str, package: str) -> str:
    path = shutil.which(tool) or (f"/usr/sbin/{tool}" if os.path.exists(f"/usr/sbin/{tool}") else None)
    if path is None:
        raise Unavailable(f"building a VM disk needs {tool}, which is not installed", field="disk",
                          fix=f"apt-get install -y {package}")
    return path


def _run(argv: list[str], what: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Unavailable(f"{what} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-1500:]}",
                          field="disk", fix="see the error; the disk was not changed")
    return proc.stdout


def _version_key(v: str) -> list:
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", v)]


def find_kernel(root: Path) -> tuple[str, Path, Path | None]:
    """The image's newest /boot/vmlinuz-<ver> and its /boot/initrd.img-<ver> (if any)."""
    boot = root / "boot"
    kernels = sorted((p for p in boot.glob("vmlinuz-*") if p.is_file()),
                     key=lambda p: _version_key(p.name)) if boot.is_dir() else []
    if not kernels:
        raise InvalidArgument("the image has no kernel: a full-VM disk boots the image's own kernel "
                              "(/boot/vmlinuz-*)", field="image",
                              fix="install a kernel in the image (Debian: linux-image-cloud-amd64), "
                                  "or use the image without `disk` (the project's kernel boots its layers)")
    k = kernels[-1]
    version = k.name.removeprefix("vmlinuz-")
    initrd = boot / f"initrd.img-{version}"
    return version, k, initrd if initrd.is_file() else None


def check_init(root: Path) -> None:
    init = root / "sbin" / "init"
    if not (init.is_file() or init.is_symlink()):
        raise InvalidArgument("the image has no /sbin/init: a full-VM disk boots the image's own init",
                              field="image", fix="install an init in the image (Debian: systemd-sysv)")
    if not (root / "lib" / "systemd" / "systemd").exists() and not (root / "usr/lib/systemd/systemd").exists():
        raise InvalidArgument("the image's init is not systemd: the dsec agent is started by a systemd unit",
                              field="image", fix="install systemd-sysv in the image")


def _agent_unit(workdir: str, uid: int, gid: int) -> str:
    dev = "dev-virtio\\x2dports-dsec.agent.device"   # systemd's escaped name of AGENT_PORT
    return f"""[Unit]
Description=dsec guest agent (host channel: virtio-serial port dsec.agent)
# the port's device unit exists because 90-dsec-agent.rules tags it for systemd
BindsTo={dev}
After={dev} local-fs.target

[Service]
ExecStart=/.dsec/agent -D {AGENT_PORT} -w {workdir} -u {uid} -g {gid} -n 4096
Restart=always
RestartSec=0.2
# the OOM killer should pick a command, not the channel to the host (as for the agent as PID 1)
OOMScoreAdjust=-1000
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
"""


def customize(root: Path, agent: Path, *, uid: int, gid: int, workdir: str) -> None:
    """Write the dsec additions into the (overlay) tree `root`."""
    (root / ".dsec").mkdir(mode=0o755, exist_ok=True)
    shutil.copyfile(agent, root / ".dsec" / "agent")
    os.chmod(root / ".dsec" / "agent", 0o755)
    sysd = root / "etc" / "systemd" / "system"
    (sysd / "multi-user.target.wants").mkdir(parents=True, exist_ok=True)
    (sysd / "dsec-agent.service").write_text(_agent_unit(workdir, uid, gid))
    link = sysd / "multi-user.target.wants" / "dsec-agent.service"
    link.unlink(missing_ok=True)
    link.symlink_to("/etc/systemd/system/dsec-agent.service")
    for unit in MASKED_UNITS:
        m = sysd / unit
        if m.is_symlink() or m.exists():
            m.unlink()
        m.symlink_to("/dev/null")
    rules = root / "etc" / "udev" / "rules.d"
    rules.mkdir(parents=True, exist_ok=True)
    (rules / "90-dsec-agent.rules").write_text(
        'SUBSYSTEM=="virtio-ports", ATTR{name}=="dsec.agent", TAG+="systemd"\n')
    (root / "etc" / "fstab").write_text("/dev/vda / ext4 rw,noatime 0 0\n")   # pass 0: no fsck at boot
    (root / "etc" / "hostname").write_text("sandbox\n")
    wd = root / workdir.lstrip("/")
    if not wd.exists():
        wd.mkdir(parents=True, mode=0o755)
        os.chown(wd, uid, gid)


def _merged_tree_script(layers: list[Path], upper: Path, work: Path, merged: Path, py: str) -> str:
    """Shell run inside `unshare -m`: mount the layers and the overlay, then call back into
    Python (`py`) for the steps that need the merged tree. The namespace dies with it."""
    lines = ["set -e", "mount --make-rprivate /"]
    lowers = []
    for i, lay in enumerate(layers):
        d = merged.parent / f"l{i}"
        lines.append(f"mkdir -p '{d}' && mount -t erofs -o ro,loop '{lay}' '{d}'")
        lowers.insert(0, str(d))               # overlay wants the top layer first
    lines.append(f"mount -t overlay -o lowerdir={':'.join(lowers)},upperdir={upper},workdir={work} dsec-disk '{merged}'")
    lines.append(py)
    return "\n".join(lines)


def build(paths: Paths, name: str, image: str, *, size_mb: int | None = None,
          uid: int = 1000, gid: int = 1000, workdir: str = "/work") -> DiskInfo:
    """Build (or rebuild) VM disk `name` from `image` (see the module docstring)."""
    from dsec.agent.build import agent_binary
    from dsec.images.service import ImageService

    if not DISK_NAME_RE.match(name):
        raise InvalidArgument(f"{name!r} is not a valid disk name", field="name",
                              fix="use lowercase letters, digits, '.', '_' and '-' (at most 63)")
    if size_mb is not None and not 256 <= size_mb <= 1024 * 1024:
        raise InvalidArgument(f"size {size_mb} MiB is out of range", field="size_mb", fix="use 256 .. 1048576")
    for tool, pkg in (("mkfs.ext4", "e2fsprogs"), ("qemu-img", "qemu-utils"), ("unshare", "util-linux")):
        _need(tool, pkg)
    svc = ImageService(paths)
    info = svc.get(image)
    layers = [svc.layer_source(lay.digest) for lay in info.layers]
    agent = agent_binary(paths.bin)
    out_dir = disks_dir(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with FileLock(out_dir / f".{name}.lock"), tempfile.TemporaryDirectory(prefix=f".build-{name}-", dir=out_dir) as tmp:
        t = Path(tmp)
        for sub in ("upper", "work", "merged"):
            (t / sub).mkdir()
        raw = t / "root.ext4"
        result = t / "result.json"
        # the part that needs the merged tree runs in Python inside the private namespace
        py = (f"'{sys.executable}' -m dsec.backends.vm.disks _inside "
              f"'{t / 'merged'}' '{agent}' '{raw}' '{result}' {size_mb or 0} {uid} {gid} '{workdir}' '{t}'")
        script = _merged_tree_script(layers, t / "upper", t / "work", t / "merged", py)
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            err = proc.stderr.strip()
            for line in reversed(err.splitlines()):   # a DsecError raised inside: pass it on as is
                if line.startswith("DSEC-ERROR "):
                    e = json.loads(line.removeprefix("DSEC-ERROR "))
                    raise InvalidArgument(e["message"], field=e.get("field") or "image", fix=e.get("fix") or "")
            raise Unavailable(f"building VM disk {name} failed: {err[-1500:]}", field="disk",
                              fix="see the error (mount/mkfs.ext4 output)")
        r = json.loads(result.read_text())
        qcow = t / "disk.qcow2"
        # convert compacts: only blocks ext4 wrote end up in the file (the rest reads as zeroes)
        _run(["qemu-img", "convert", "-q", "-O", "qcow2", str(raw), str(qcow)], "qemu-img convert")
        with FileLock(out_dir / ".lock"):
            for src, suffix in ((qcow, "qcow2"), (t / "vmlinuz", "vmlinuz"), (t / "initrd", "initrd")):
                if src.exists():
                    os.replace(src, out_dir / f"{name}.{suffix}")
                else:
                    (out_dir / f"{name}.{suffix}").unlink(missing_ok=True)
            disk = DiskInfo(name=name, image=info.name, image_digest=info.digest, kernel_version=r["kernel"],
                            size_mb=r["size_mb"], build_id=os.urandom(6).hex(), created_at=time.time(),
                            uid=uid, gid=gid, workdir=workdir, has_initrd=r["initrd"])
            disks = _load(paths)
            disks[name] = disk
            _save(paths, disks)
    log.info("vm disk built", extra={"disk": name, "image": info.name, "seconds": round(time.monotonic() - t0, 1)})
    return disk


def _inside(merged: Path, agent: Path, raw: Path, result: Path, size_mb: int, uid: int, gid: int,
            workdir: str, tmp: Path) -> None:
    """Runs in the private mount namespace with the merged tree mounted at `merged`."""
    version, kernel, initrd = find_kernel(merged)
    check_init(merged)
    shutil.copyfile(kernel, tmp / "vmlinuz")
    if initrd is not None:
        shutil.copyfile(initrd, tmp / "initrd")
    customize(merged, agent, uid=uid, gid=gid, workdir=workdir)
    used_mb = int(subprocess.run(["du", "-sxm", str(merged)], capture_output=True, text=True,
                                 check=True).stdout.split()[0])
    # default: what the tree uses plus room to work in (the file stays sparse on the host)
    size = size_mb or max(1024, used_mb * 2 + 512)
    if size < used_mb + 64:
        raise InvalidArgument(f"{size} MiB is too small for the image ({used_mb} MiB of files)",
                              field="size_mb", fix=f"use --size-mb {used_mb + 256} or more")
    with open(raw, "wb") as f:
        f.truncate(size << 20)
    _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-L", "dsec-root", "-E", "lazy_itable_init=1,lazy_journal_init=1",
          "-d", str(merged), str(raw)], "mkfs.ext4 -d")
    result.write_text(json.dumps({"kernel": version, "initrd": initrd is not None, "size_mb": size}))


if __name__ == "__main__":
    from dsec.types import DsecError
    if len(sys.argv) == 11 and sys.argv[1] == "_inside":
        a = sys.argv[2:]
        try:
            _inside(Path(a[0]), Path(a[1]), Path(a[2]), Path(a[3]), int(a[4]), int(a[5]), int(a[6]), a[7], Path(a[8]))
        except DsecError as e:
            print("DSEC-ERROR " + json.dumps({"message": e.message, "field": getattr(e, "field", None),
                                             "fix": getattr(e, "fix", None)}), file=sys.stderr)
            sys.exit(3)
        sys.exit(0)
    sys.exit(2)
