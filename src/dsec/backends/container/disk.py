"""Per-sandbox disk quota of the writable layer (overlay upper + work), see docs/decisions.md D11.

This host's /var/lib is ext4 without project quota, and the kernel has neither QFMT_V2 (ext4
quota) nor XFS quota; btrfs quota groups work. So, once per node:

    DSEC_HOME/scratch.img    one file holding a btrfs, *fully allocated* on DSEC_HOME's
                             filesystem (fallocate; never sparse): the host cannot run out of
                             blocks under it, so a full host disk is never an I/O error inside
                             btrfs (which would lose written data and force it read-only).
                             It starts at DSEC_SCRATCH_INITIAL_GB (4) and grows in steps while
                             DSEC_HOME keeps twice DSEC_HOME_RESERVE_MB free, up to
                             DSEC_SCRATCH_GB (`ScratchImage`)
    DSEC_HOME/sb             its mount point (loop device with direct I/O, detached at once so
                             it goes away with the mount; no discard: freed blocks stay with
                             the image for the next sandbox), simple quotas enabled (full
                             qgroups on kernels before 6.7)

and per sandbox the directory sb/<id> is a btrfs *subvolume* with a quota-group limit of
disk_mb (`BtrfsQuotas`): writes beyond it fail with EDQUOT inside the sandbox (root included:
btrfs has no capability bypass), the node's own filesystem and other sandboxes are unaffected
(up to the scratch filesystem's size, which is overcommitted like memory: a full scratch is
ENOSPC for its writers, and admission refuses new sandboxes before that). Creating a
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
import threading
import time
from pathlib import Path

from dsec.config import Paths
from dsec.settings import StorageSettings

log = logging.getLogger("dsec.backends.container.disk")

IMAGE_NAME = "scratch.img"
BTRFS_MAGIC = 0x9123683E
MIB, GIB = 1 << 20, 1 << 30
MIN_IMAGE = GIB
GROW_STEP = GIB          # at least this much per growth step (or a quarter of the size)
GROW_BELOW = 512 * MIB   # grow when the scratch has less free (or an eighth of its size)
# commit=5: a scratch that filled up, then had files deleted, hands the emptied data block
# groups back within seconds (metadata needs them: until then even creating a file is ENOSPC;
# with the default 30 s commit that lasted ~20 s here)
MOUNT_OPTS = "noatime,nodiscard,commit=5"

# btrfs ioctls (linux/btrfs.h); vol_args is {s64 fd; char name[4088]}
_IOC_SUBVOL_CREATE = 0x5000940E
_IOC_SNAP_DESTROY = 0x5000940F
_IOC_QUOTA_CTL = 0xC0109428          # {u64 cmd; u64 status}
_IOC_QGROUP_LIMIT = 0x8030942B       # {u64 qgroupid; {u64 flags, max_rfer, max_excl, rsv_rfer, rsv_excl}}
_IOC_RESIZE = 0x50009403           # vol_args, name "devid:size" or "devid:max"
_LOOP_SET_CAPACITY = 0x4C07
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

    def __init__(self, paths: Paths, mode: str, scratch: "ScratchImage | None" = None):
        super().__init__(paths)
        self.kind = f"btrfs-{mode}"
        self.scratch = scratch      # None: sb/ is a btrfs the operator mounted (not ours to grow)

    def create_dir(self, d: Path, limit_bytes: int) -> None:
        if self.scratch is not None:
            self.scratch.grow_if_needed()   # a burst of creates does not wait for the watcher
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


def _avail(p: Path) -> int:
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


class ScratchImage:
    """DSEC_HOME/scratch.img, the btrfs behind sb/: always fully allocated on the host
    filesystem, so btrfs never writes into a hole the host cannot fill (that is EIO inside
    btrfs: acknowledged writes lost, the filesystem forced read-only for every sandbox).
    Grown in steps (fallocate the new tail, tell the loop device, resize btrfs: ~ms) by
    `grow_if_needed`, which a watcher thread calls every DSEC_SCRATCH_CHECK_S seconds and
    every sandbox creation calls first."""

    def __init__(self, paths: Paths, s: StorageSettings):
        self.home, self.img, self.mnt = paths.home, paths.home / IMAGE_NAME, paths.sandboxes
        self.cap = int(s.scratch_gb * GIB) if s.scratch_gb is not None else None
        self.initial = int(s.scratch_initial_gb * GIB)
        # DSEC_HOME's filesystem keeps this free for what is not the scratch (layer store, records,
        # builds, VM disks): admission refuses new sandboxes below it (edge/admission.py reads the
        # same DSEC_HOME_RESERVE_MB), and the scratch grows only while twice that stays
        self.home_reserve = s.home_reserve_mb * MIB
        self.check_s = s.scratch_check_s
        self._lock = threading.Lock()
        self._said: str | None = None      # the last "cannot grow" reason logged

    def room(self) -> int:
        """Bytes the image may still take: what keeps 2 x DSEC_HOME_RESERVE_MB free on the
        host filesystem, and no more than DSEC_SCRATCH_GB in all."""
        size = self.img.stat().st_size if self.img.exists() else 0
        room = _avail(self.home) - 2 * self.home_reserve
        if self.cap is not None:
            room = min(room, self.cap - size)
        return max(room, 0) // MIB * MIB

    def create(self) -> None:
        size = min(self.initial, self.room())
        if size < MIN_IMAGE:
            raise OSError(f"only {size >> 20} MiB of {self.home}'s filesystem can hold the scratch filesystem "
                          f"(need >= 1 GiB above 2 x DSEC_HOME_RESERVE_MB={self.home_reserve >> 20} MiB free; "
                          "free space there, or set DSEC_SCRATCH_GB / DSEC_HOME_RESERVE_MB)")
        tmp = self.img.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, size)   # allocated, not sparse (instant on ext4/xfs)
            _run("mkfs.btrfs", "-q", "-f", "-K", "-m", "single", "-d", "single", "-L", "dsec-scratch", str(tmp))
            os.replace(tmp, self.img)
        finally:
            tmp.unlink(missing_ok=True)
        log.info("scratch filesystem created", extra={"image": str(self.img), "mib": size >> 20})

    def mount(self) -> None:
        loop = _run("losetup", "--find", "--show", "--direct-io=on", str(self.img))
        try:
            _run("mount", "-t", "btrfs", "-o", MOUNT_OPTS, loop, str(self.mnt))
        finally:
            subprocess.run(["losetup", "-d", loop], capture_output=True)   # autoclear once unmounted
        os.chmod(self.mnt, 0o700)

    def _loop_device(self) -> str | None:
        """The loop device mounted on sb/, if its backing file is our image."""
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if parts[4] == str(self.mnt):
                    src = parts[parts.index("-") + 2]
                    name = os.path.basename(src)
                    try:
                        backing = Path(f"/sys/block/{name}/loop/backing_file").read_text().strip()
                    except OSError:
                        return None
                    return src if os.path.realpath(backing) == os.path.realpath(self.img) else None
        return None

    def ours(self) -> bool:
        return self.img.exists() and self._loop_device() is not None

    def settle(self) -> None:
        """On every start, for an image this or an older dsec made: no discard (it would punch
        holes into the image), every block allocated, btrfs as large as the file. An older
        sparse image (90% of the free space, allocated as written) is first shrunk online to
        what it holds plus two growth steps, then grows on demand like a new one."""
        opts = subprocess.run(["findmnt", "-no", "OPTIONS", str(self.mnt)], capture_output=True,
                              text=True).stdout.strip().split(",")
        if any(o == "discard" or o.startswith("discard=") for o in opts) or "commit=5" not in opts:
            _run("mount", "-o", "remount,nodiscard,commit=5", str(self.mnt))
        st = self.img.stat()
        if st.st_blocks * 512 < st.st_size:
            vfs = os.statvfs(self.mnt)
            used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
            target = max(MIN_IMAGE, min(self.initial, st.st_size), -(-(used + 2 * GROW_STEP) // GIB) * GIB)
            if target < st.st_size:
                _dir_ioctl(self.mnt, _IOC_RESIZE, _vol_args(f"1:{target}"))   # moves chunks down, online
                os.truncate(self.img, target)
                self._set_capacity()
                log.warning("shrank a sparse scratch filesystem; it is allocated on the host now and grows on demand",
                            extra={"image": str(self.img), "from_mib": st.st_size >> 20, "to_mib": target >> 20})
            with open(self.img, "r+b") as f:
                os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)   # fills the holes only
        self._set_capacity()

    def _set_capacity(self) -> None:
        loop = self._loop_device()
        if loop is None:
            raise OSError(f"{self.mnt} is no longer our loop-mounted scratch image")
        fd = os.open(loop, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _LOOP_SET_CAPACITY, 0)
        finally:
            os.close(fd)
        _dir_ioctl(self.mnt, _IOC_RESIZE, _vol_args("1:max"))

    def grow_if_needed(self) -> None:
        with self._lock:
            if _fs_magic(self.mnt) != BTRFS_MAGIC:
                return                                  # unmounted (dsec down, a test's cleanup)
            size = self.img.stat().st_size
            if _avail(self.mnt) >= max(GROW_BELOW, size // 8):
                return
            step = min(max(GROW_STEP, size // 4), self.room())
            if step < 128 * MIB:
                why = ("the scratch filesystem is nearly full and cannot grow: DSEC_SCRATCH_GB reached"
                       if self.cap is not None and size + GROW_STEP > self.cap else
                       f"the scratch filesystem is nearly full and cannot grow: {self.home}'s filesystem keeps "
                       f"2 x DSEC_HOME_RESERVE_MB={self.home_reserve >> 20} MiB free")
                if why != self._said:
                    self._said = why
                    log.warning(why, extra={"image": str(self.img), "mib": size >> 20})
                return
            with open(self.img, "r+b") as f:
                os.posix_fallocate(f.fileno(), size, step)
            self._set_capacity()
            self._said = None
            log.info("scratch filesystem grown", extra={"image": str(self.img), "mib": (size + step) >> 20})

    def watch(self) -> None:
        """Grow in the background too: sandboxes fill the scratch between creations."""
        def loop() -> None:
            while True:
                try:
                    self.grow_if_needed()
                except Exception as e:   # keep watching; the next tick retries
                    msg = f"could not grow the scratch filesystem: {e}"
                    if msg != self._said:
                        self._said = msg
                        log.warning(msg, extra={"image": str(self.img)})
                time.sleep(self.check_s)
        threading.Thread(target=loop, name="dsec-scratch", daemon=True).start()


def open_quotas(paths: Paths, s: StorageSettings) -> PolledQuotas:
    """The node's quota mechanism (DSEC_DISK_QUOTA), setting up the scratch filesystem on first use."""
    want = s.disk_quota
    if want == "poll":
        return PolledQuotas(paths, "DSEC_DISK_QUOTA=poll")
    mnt = paths.sandboxes
    scratch = ScratchImage(paths, s)
    try:
        mnt.mkdir(parents=True, exist_ok=True)
        if not _is_mountpoint(mnt):
            if any(mnt.iterdir()):
                raise OSError(f"{mnt} holds sandboxes of a dsec without disk quotas; "
                              "stop them (or drain the node) and restart to enable quotas")
            if not shutil.which("mkfs.btrfs") and not (paths.home / IMAGE_NAME).exists():
                raise OSError("mkfs.btrfs is missing (Debian package btrfs-progs; scripts/install.sh installs it)")
            if not scratch.img.exists():
                scratch.create()
            scratch.mount()
        if _fs_magic(mnt) != BTRFS_MAGIC:
            raise OSError(f"{mnt} is a mount point but not btrfs")
        if os.statvfs(mnt).f_flag & os.ST_RDONLY:
            raise OSError(f"{mnt} is read-only (btrfs forces that after an I/O error, see dmesg): stop dsec and "
                          f"its sandboxes, `umount {mnt}`, free space on {paths.home}'s filesystem, start again")
        ours = scratch.ours()       # else a btrfs the operator mounted there: used as it is
        if ours:
            scratch.settle()
            scratch.grow_if_needed()
            scratch.watch()
        mode = _enable_quota(mnt)
    except (OSError, ValueError) as e:
        log.warning("no kernel-enforced disk quota; falling back to polling the writable layers",
                    extra={"reason": str(e)})
        if want == "btrfs":
            raise
        return PolledQuotas(paths, str(e))
    log.info("disk quotas: btrfs subvolumes", extra={"mode": mode, "mount": str(mnt)})
    return BtrfsQuotas(paths, mode, scratch if ours else None)
