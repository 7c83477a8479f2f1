"""Per-sandbox disk quota of the writable layer (overlay upper + work), see docs/decisions.md D11.

This host's /var/lib is ext4 without project quota, and the kernel has neither QFMT_V2 (ext4
quota) nor XFS quota; btrfs quota groups work. So, once per node:

    DSEC_HOME/scratch.img    one sparse file (size: DSEC_SCRATCH_GB, default 90% of the free
                             space of DSEC_HOME's filesystem at creation), btrfs
    DSEC_HOME/sb             its mount point (loop device with direct I/O, detached at once so
                             it goes away with the mount; discard=async gives freed blocks back
                             to the host filesystem), simple quotas enabled (full qgroups on
                             kernels before 6.7)

and per sandbox the directory sb/<id> is a btrfs *subvolume* with a quota-group limit of
disk_mb (`BtrfsQuotas`): writes beyond it fail with EDQUOT inside the sandbox (root included:
btrfs has no capability bypass), the node's own filesystem and other sandboxes are unaffected
(up to the scratch filesystem's total size, which is overcommitted like memory). Creating a
subvolume and setting its limit takes ~0.1 ms, destroying it ~0.03 ms (no rm -rf walk).

Where that is impossible (no btrfs-progs, no loop devices, DSEC_HOME/sb holds sandboxes of an
older version, DSEC_DISK_QUOTA=poll) `PolledQuotas` keeps plain directories and the edge
measures each running sandbox's upper dir every DSEC_DISK_POLL_S seconds, failing a sandbox
that exceeds its quota (so a burst can overshoot by what it writes in one interval).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import struct
import subprocess
from pathlib import Path

from dsec.config import Paths

log = logging.getLogger("dsec.backends.container.disk")

IMAGE_NAME = "scratch.img"
BTRFS_MAGIC = 0x9123683E
MIN_IMAGE = 1 << 30

# btrfs ioctls (linux/btrfs.h); vol_args is {s64 fd; char name[4088]}
_IOC_SUBVOL_CREATE = 0x5000940E
_IOC_SNAP_DESTROY = 0x5000940F
_IOC_QUOTA_CTL = 0xC0109428          # {u64 cmd; u64 status}
_IOC_QGROUP_LIMIT = 0x8030942B       # {u64 qgroupid; {u64 flags, max_rfer, max_excl, rsv_rfer, rsv_excl}}
_QUOTA_CTL_ENABLE = 1
_QUOTA_CTL_ENABLE_SIMPLE = 4
_LIMIT_MAX_RFER = 1


def _vol_args(name: str) -> bytearray:
    raw = os.fsencode(name)
    if not raw or len(raw) >= 4088 or b"/" in raw:
        raise ValueError(f"bad subvolume name {name!r}")
    return bytearray(struct.pack("q", 0) + raw + b"\0" * (4088 - len(raw)))


def _dir_ioctl(path: Path, req: int, arg: bytearray) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, req, arg)
    finally:
        os.close(fd)


def _is_mountpoint(p: Path) -> bool:
    try:
        return os.path.ismount(p)
    except OSError:
        return False


def _fs_magic(p: Path) -> int:
    import ctypes

    buf = ctypes.create_string_buffer(120)   # struct statfs (x86_64: 120 bytes); f_type first
    if ctypes.CDLL(None, use_errno=True).statfs(os.fsencode(str(p)), buf) != 0:
        return 0
    return struct.unpack_from("l", buf.raw)[0] & 0xFFFFFFFF


class PolledQuotas:
    """Fallback: plain directories; the edge measures usage and fails offenders."""

    kind = "poll"
    enforced = False

    def __init__(self, paths: Paths, reason: str = ""):
        self.paths = paths
        self.reason = reason

    def create_dir(self, d: Path, limit_bytes: int) -> None:
        d.mkdir(mode=0o700, parents=True, exist_ok=False)

    def remove_dir(self, d: Path) -> None:
        shutil.rmtree(d, ignore_errors=True)

    @staticmethod
    def usage(upper: Path) -> int:
        """Bytes allocated under `upper` (hard links counted once). ~10 us per file."""
        total, seen, stack = 0, set(), [str(upper)]
        while stack:
            try:
                it = os.scandir(stack.pop())
            except OSError:
                continue
            with it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    if st.st_nlink > 1 and not e.is_dir(follow_symlinks=False):
                        if (st.st_dev, st.st_ino) in seen:
                            continue
                        seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        return total


class BtrfsQuotas(PolledQuotas):
    """sb/ is a loop-mounted btrfs; every sandbox dir is a subvolume with a qgroup limit."""

    kind = "btrfs"
    enforced = True

    def __init__(self, paths: Paths, mode: str):
        super().__init__(paths)
        self.kind = f"btrfs-{mode}"

    def create_dir(self, d: Path, limit_bytes: int) -> None:
        _dir_ioctl(d.parent, _IOC_SUBVOL_CREATE, _vol_args(d.name))   # EEXIST like mkdir
        try:
            os.chmod(d, 0o700)
            lim = struct.pack("QQQQQQ", 0, _LIMIT_MAX_RFER, limit_bytes, 0, 0, 0)   # qgroup 0: this subvolume
            _dir_ioctl(d, _IOC_QGROUP_LIMIT, bytearray(lim))
        except BaseException:
            self.remove_dir(d)
            raise

    def remove_dir(self, d: Path) -> None:
        """Drop the whole subvolume at once (its qgroup goes with it); a plain directory
        (e.g. left by a half-finished create) is removed the slow way."""
        try:
            _dir_ioctl(d.parent, _IOC_SNAP_DESTROY, _vol_args(d.name))
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTTY, errno.EPERM, errno.ENOTDIR):
                log.warning("subvolume delete failed, removing files", extra={"path": str(d), "error": str(e)})
        shutil.rmtree(d, ignore_errors=True)


def _run(*argv: str) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise OSError(f"{' '.join(argv)}: exit {p.returncode}: {(p.stderr or p.stdout).strip()[-400:]}")
    return p.stdout.strip()


def _enable_quota(mnt: Path) -> str:
    """Simple quotas (6.7+: no backref walks, ~10% on a small-file untar) else full qgroups
    (~45%). Enabling when already enabled is a no-op."""
    for cmd, mode in ((_QUOTA_CTL_ENABLE_SIMPLE, "squota"), (_QUOTA_CTL_ENABLE, "qgroup")):
        try:
            _dir_ioctl(mnt, _IOC_QUOTA_CTL, bytearray(struct.pack("QQ", cmd, 0)))
            return mode
        except OSError as e:
            last = e
    raise last


def _image_size(home: Path) -> int:
    gb = os.environ.get("DSEC_SCRATCH_GB")
    if gb:
        return int(float(gb) * (1 << 30))
    st = os.statvfs(home)
    return int(st.f_bavail * st.f_frsize * 0.9)


def _mount_scratch(paths: Paths) -> None:
    img, mnt = paths.home / IMAGE_NAME, paths.sandboxes
    if not img.exists():
        size = _image_size(paths.home)
        if size < MIN_IMAGE:
            raise OSError(f"only {size >> 20} MiB for the scratch filesystem (need >= 1 GiB; set DSEC_SCRATCH_GB)")
        tmp = img.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.truncate(size)   # sparse
        _run("mkfs.btrfs", "-q", "-f", "-m", "single", "-d", "single", "-L", "dsec-scratch", str(tmp))
        os.replace(tmp, img)
    loop = _run("losetup", "--find", "--show", "--direct-io=on", str(img))
    try:
        _run("mount", "-t", "btrfs", "-o", "noatime,discard=async", loop, str(mnt))
    finally:
        subprocess.run(["losetup", "-d", loop], capture_output=True)   # autoclear once unmounted
    os.chmod(mnt, 0o700)


def open_quotas(paths: Paths) -> PolledQuotas:
    """The node's quota mechanism, setting up the scratch filesystem on first use."""
    want = os.environ.get("DSEC_DISK_QUOTA", "auto")
    if want == "poll":
        return PolledQuotas(paths, "DSEC_DISK_QUOTA=poll")
    mnt = paths.sandboxes
    try:
        mnt.mkdir(parents=True, exist_ok=True)
        if not _is_mountpoint(mnt):
            if any(mnt.iterdir()):
                raise OSError(f"{mnt} holds sandboxes of a dsec without disk quotas; "
                              "stop them (or drain the node) and restart to enable quotas")
            if not shutil.which("mkfs.btrfs") and not (paths.home / IMAGE_NAME).exists():
                raise OSError("mkfs.btrfs is missing (Debian package btrfs-progs; scripts/install.sh installs it)")
            _mount_scratch(paths)
        if _fs_magic(mnt) != BTRFS_MAGIC:
            raise OSError(f"{mnt} is a mount point but not btrfs")
        mode = _enable_quota(mnt)
    except (OSError, ValueError) as e:
        log.warning("no kernel-enforced disk quota; falling back to polling the writable layers",
                    extra={"reason": str(e)})
        if want == "btrfs":
            raise
        return PolledQuotas(paths, str(e))
    log.info("disk quotas: btrfs subvolumes", extra={"mode": mode, "mount": str(mnt)})
    return BtrfsQuotas(paths, mode)
