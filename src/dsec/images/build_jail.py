"""The namespaces buildah runs in: a view of the host that holds only what a build needs.

buildah 1.28 (Debian 12) runs as host root and resolves some paths of a Dockerfile in its own
mount namespace (`RUN --mount=type=bind,from=STAGE,source=/link-to-root` saw the host's `/`
before 1.35.1), and `ADD <url>` fetches from its own network namespace. So every buildah
command runs under `unshare` in new mount, network, pid, IPC and UTS namespaces, pivoted into
a tmpfs root that holds:

  /usr (and the /bin, /sbin, /lib, /lib64 links or dirs) read-only, a few /etc files
  read-only (users, libc and alternatives; buildah's config is passed explicitly), synthetic
  /etc/hosts and /etc/resolv.conf, a minimal /dev, a fresh /proc of the new pid namespace,
  a read-only sysfs of its own with the host's cgroup mounts (crun sets the RUN steps' limits
  there), empty /tmp
  and /run, and the paths the command names: buildah's own storage read-write, the build's
  scratch dir read-write, the build context read-only.

Nothing else of the host is there to reach: not DSEC_HOME's keys, databases or sandboxes, not
other checkouts, not /var/tmp, not a PostgreSQL socket, and no network but a loopback of its
own. Mounts made inside (buildah's overlays) live and die with the namespace.

Not (yet) a user namespace: buildah's storage holds files of every owner, which needs it to
run as root of a full id range; its RUN steps do run in one (dockerfile.py: an unprivileged
host id slot per build).
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.types import Unavailable

ETC_FILES = ("passwd", "group", "nsswitch.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
             "alternatives", "containers", "localtime")
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
TOP_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True)
class Bind:
    path: Path              # the same path inside as outside
    writable: bool = False


def unshare_binary() -> str:
    path = shutil.which("unshare")
    if path is None:
        raise Unavailable("unshare (util-linux) is not installed; builds run in their own namespaces",
                          fix="apt-get install -y util-linux")
    return path


def _script(root: Path, binds: Sequence[Bind], cwd: Path | None) -> str:
    """The shell steps run inside the new namespaces before buildah is exec'd ("$@")."""
    q = shlex.quote
    r = q(str(root))
    lines = ["set -eu", f"R={r}", 'mount -t tmpfs -o mode=0755,nosuid,nodev dsec-build-root "$R"',
             'mkdir -p "$R/usr" "$R/etc" "$R/dev" "$R/proc" "$R/sys" "$R/tmp" "$R/run" "$R/.old"',
             'mount --rbind /usr "$R/usr"', 'mount -o remount,bind,ro "$R/usr"']
    for name in TOP_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            lines.append(f'ln -s {q(os.readlink(host))} "$R/{name}"')
        elif host.is_dir():
            lines += [f'mkdir -p "$R/{name}"', f'mount --rbind /{name} "$R/{name}"',
                      f'mount -o remount,bind,ro "$R/{name}"']
    for name in ETC_FILES:
        host = Path("/etc") / name
        if not host.exists():
            continue
        make = "mkdir -p" if host.is_dir() else "touch"
        lines += [f'{make} "$R/etc/{name}"', f'mount --bind /etc/{name} "$R/etc/{name}"',
                  f'mount -o remount,bind,ro "$R/etc/{name}"']
    lines += ["printf '127.0.0.1 localhost\\n::1 localhost\\n' > \"$R/etc/hosts\"",
              "printf 'nameserver 127.0.0.1\\n' > \"$R/etc/resolv.conf\"",
              "printf 'dsec-build\\n' > \"$R/etc/hostname\"", "hostname dsec-build",
              'mount -t tmpfs -o mode=0755,nosuid dsec-build-dev "$R/dev"',
              'mkdir -p "$R/dev/shm" "$R/dev/pts" && mount -t tmpfs -o mode=1777,nosuid,nodev shm "$R/dev/shm"']
    for node in DEV_NODES:
        if Path("/dev", node).exists():
            lines += [f'touch "$R/dev/{node}"', f'mount --bind /dev/{node} "$R/dev/{node}"']
    lines += ['ln -s /proc/self/fd "$R/dev/fd"',
              'mount -t proc -o nosuid,nodev,noexec proc "$R/proc"',
              # a sysfs of the new network namespace (the host's would list its interfaces)
              'mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$R/sys"',
              'mount --rbind /sys/fs/cgroup "$R/sys/fs/cgroup"',
              'mount -t tmpfs -o mode=1777,nosuid,nodev tmp "$R/tmp"',
              'mount -t tmpfs -o mode=0755,nosuid,nodev run "$R/run"']
    for b in sorted(binds, key=lambda b: len(b.path.parts)):       # parents before children
        inside = f'"$R"{q(str(b.path))}'
        lines += [f"mkdir -p {inside}", f"mount --bind {q(str(b.path))} {inside}"]
        if not b.writable:
            lines.append(f"mount -o remount,bind,ro {inside}")
    lines += ['cd "$R"', "pivot_root . .old", "umount -l /.old", "rmdir /.old",
              f"cd {q(str(cwd or '/'))}", 'exec "$@"']
    return "\n".join(lines)


def jailed(argv: Sequence[str], *, root: Path, binds: Sequence[Bind], cwd: Path | None = None) -> list[str]:
    """argv run in new mount, network, pid, IPC and UTS namespaces whose root holds only the
    system's programs and `binds` (module doc). `root`: an empty host directory to build that
    root on (a private mount point: the host never sees what is mounted there)."""
    root.mkdir(parents=True, exist_ok=True)
    if cwd is not None and not any(cwd == b.path or cwd.is_relative_to(b.path) for b in binds):
        raise ValueError(f"the build's working directory {cwd} is not among its binds")
    return [unshare_binary(), "--mount", "--net", "--pid", "--ipc", "--uts", "--fork",
            "--kill-child=SIGKILL", "--propagation", "private", "--",
            "/bin/sh", "-c", _script(root, binds, cwd), "dsec-build-jail", *argv]
