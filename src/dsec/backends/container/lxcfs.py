"""The node's lxcfs daemon: /proc/meminfo, /proc/cpuinfo, ... as the reading process's cgroups
see them (D50). One FUSE mount per dsec home (<home>/lxcfs), started by the container driver
(dsec up, the embedded server, cluster edges), never by systemd; it outlives edge restarts, as
the sandboxes do, and is stopped by a clean edge close that leaves no sandbox (the driver's
release_node, D101). Each sandbox gets bind mounts of the VIEW_FILES over its own (spec.py).

When the daemon dies its FUSE connection is gone for good: every bind of it reads ENOTCONN.
The driver watches the daemon's pidfd, starts a new one and moves fresh binds into every
running sandbox (viewmounts.py), or takes the dead ones away if no daemon will start.

`setsid -f` frees the daemon from its starter's session, not from its starter's cgroups: it was
left in the cgroup of whatever ran the edge (a systemd unit, a CI job, a shell's scope), and
whoever ends that cgroup's processes (`systemctl stop` with the default KillMode, a job runner
cleaning up after a test run) killed it too, leaving its FUSE mount behind (found twice on the
default home after full test runs). So the daemon is moved into a cgroup of dsec's own,
DAEMON_CGROUP, in every hierarchy, as the sandboxes (crun) and VMs (qemu.py) already are.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

log = logging.getLogger("dsec.backends.container.lxcfs")

# What lxcfs shows per cgroup that a program sizes itself by: `free`/MemTotal (meminfo, swaps),
# os.cpu_count() (glibc's get_nprocs reads sys/.../cpu/online), `grep -c processor /proc/cpuinfo`,
# top and glibc's fallback (stat), uptime. Not loadavg (needs -l: a thread walking every cgroup),
# diskstats or slabinfo.
VIEW_FILES: tuple[str, ...] = ("proc/meminfo", "proc/cpuinfo", "proc/stat", "proc/swaps", "proc/uptime",
                               "sys/devices/system/cpu/online")
START_TIMEOUT_S = 10.0
DAEMON_CGROUP = "dsec-daemons"       # beside the sandboxes' /dsec, in every hierarchy
CGROUP_ROOT = Path("/sys/fs/cgroup")


class Lxcfs:
    """The daemon of one dsec home: its mountpoint and pidfile."""

    def __init__(self, mountpoint: Path, binary: str = "lxcfs"):
        self.mountpoint = mountpoint
        self.pidfile = mountpoint.with_name(mountpoint.name + ".pid")
        self.binary = shutil.which(binary)

    @property
    def installed(self) -> bool:
        return self.binary is not None

    def source(self, rel: str) -> Path:
        """The host path of a view file (a bind source)."""
        return self.mountpoint / rel

    def healthy(self) -> bool:
        """Mounted and answering (a dead daemon's mount answers ENOTCONN)."""
        try:
            os.stat(self.source(VIEW_FILES[0]))
            return True
        except OSError:
            return False

    def pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text())
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError):
            return None

    def ensure(self) -> tuple[int, bool]:
        """The running daemon's pid and whether it was started now, starting one (after clearing
        a dead one's mount) if none answers. Blocking. Raises OSError naming the fix."""
        pid = self.pid()
        if pid is not None and self.healthy():
            move_to_own_cgroup(pid)    # one an older dsec started is still in its starter's cgroup
            return pid, False
        if pid is not None:            # alive but not answering: a hung daemon is replaced
            _kill(pid)
        self.clear()
        # not parents=True: a home removed under a still-running edge (a test's cleanup) is not
        # made again by a restart of its lxcfs (FileNotFoundError, an OSError the callers log)
        self.mountpoint.mkdir(mode=0o755, exist_ok=True)
        if self.binary is None:
            raise OSError(errno.ENOENT, "lxcfs is not installed (apt-get install lxcfs; scripts/install.sh does it)")
        # lxcfs 5 stays in the foreground: setsid -f makes it nobody's child, so it outlives this
        # edge (sandboxes do too); its log is a file (the daemon keeps its stdio open)
        self.pidfile.unlink(missing_ok=True)
        logfile = self.mountpoint.with_name(self.mountpoint.name + ".log")
        with open(logfile, "ab") as out:
            subprocess.run(["setsid", "-f", self.binary, "--enable-pidfd", "--disable-swap", "-p", str(self.pidfile),
                            str(self.mountpoint)], stdin=subprocess.DEVNULL, stdout=out, stderr=out, check=True,
                           cwd="/")    # pins no directory of the edge's
        deadline = time.monotonic() + START_TIMEOUT_S
        while (pid := self.pid()) is None or not self.healthy():
            if time.monotonic() > deadline:
                err = logfile.read_bytes()[-500:].decode(errors="replace").strip()
                if pid is not None:
                    _kill(pid)
                raise OSError(errno.EIO, f"lxcfs did not start at {self.mountpoint} within {START_TIMEOUT_S:g} s: {err}")
            time.sleep(0.01)
        move_to_own_cgroup(pid)
        log.info("lxcfs started", extra={"pid": pid, "mountpoint": str(self.mountpoint)})
        return pid, True

    def clear(self) -> None:
        """Detach a dead daemon's mount (sandboxes' binds of it stay until repaired)."""
        if os.path.ismount(self.mountpoint) or not self.healthy_dir():
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)

    def healthy_dir(self) -> bool:
        try:
            os.stat(self.mountpoint)
            return True
        except FileNotFoundError:
            return True
        except OSError:                # ENOTCONN: a dead FUSE mount
            return False

    def stop(self) -> None:
        """Kill the daemon and detach its mount (a home with no sandbox left: the driver's
        release_node, a stale home's clearing, tests' cleanup; never while sandboxes run)."""
        pid = self.pid()
        if pid is not None:
            _kill(pid)
        self.clear()
        self.pidfile.unlink(missing_ok=True)


def move_to_own_cgroup(pid: int, root: Path = CGROUP_ROOT) -> list[Path]:
    """Move `pid` into <hierarchy>/DAEMON_CGROUP in every cgroup hierarchy mounted under `root`
    (pure v2: the one; v1/hybrid: each controller's, the named systemd one and the unified
    one), so that it outlives the cgroup of the process that started it. Returns the cgroups
    it is now in; a hierarchy that refuses is logged and skipped (the daemon still works)."""
    hierarchies = [root] if (root / "cgroup.controllers").exists() else \
        [d for d in sorted(root.iterdir()) if (d / "cgroup.procs").exists() and not d.is_symlink()]
    moved = []
    for h in hierarchies:
        d = h / DAEMON_CGROUP
        try:
            d.mkdir(exist_ok=True)
            for f in ("cpuset.cpus", "cpuset.mems"):     # v1 cpuset: a new cgroup has none
                if (d / f).exists() and not (d / f).read_text().strip():
                    (d / f).write_text((h / f).read_text())
            (d / "cgroup.procs").write_text(str(pid))
            moved.append(d)
        except OSError as e:
            log.warning("lxcfs left in its starter's cgroup of a hierarchy", extra={"cgroup": str(d), "error": str(e)})
    return moved


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
