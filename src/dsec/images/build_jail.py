"""The namespaces buildah runs in: root of a user namespace of unprivileged host ids, with a
view of the host that holds only what a build needs.

buildah 1.28 (Debian 12) resolves some paths of a Dockerfile in its own mount namespace (`RUN
--mount=type=bind,from=STAGE,source=/link-to-root` saw the host's `/` before 1.35.1), and `ADD
<url>` fetches from its own network namespace. So every buildah command runs:

  as root of a new user namespace whose maps hold only unprivileged host ids (dockerfile.py's
  BUILDAH_IDS: its root is one fixed host id, its storage is owned by it, and RUN steps' slots
  are mapped to themselves so their own nested maps mean the same host ids), made by
  dsec-build-userns (userns_exec.c: util-linux 2.38's --map-users only maps /etc/subuid
  ranges);
  in new mount, network, pid, IPC and UTS namespaces owned by it, pivoted into a tmpfs root that
  holds /usr (and the /bin, /sbin, /lib, /lib64 links or dirs) read-only, a few /etc files
  read-only (users, libc and alternatives; buildah's config is passed explicitly), synthetic
  /etc/hosts and /etc/resolv.conf, a minimal /dev, a fresh /proc of the new pid namespace, a
  read-only sysfs of its own with the host's cgroup mounts, empty /tmp and /run, and the paths
  the command names: buildah's own storage read-write, the build's scratch dir read-write, the
  build context read-only;
  in cgroups the host made for the build (build_cgroups: memory and pids limits for buildah and
  its RUN steps together; crun, root of the user namespace only, may make none).

Two stages: host root builds the root tree in a private mount namespace (so binds of paths
under host directories the namespace's root may not search, like a 0700 home, work), then
execs the helper, which enters the user namespace, and `unshare` the other namespaces; there,
from the tmpfs's top (relative paths: nothing of the host is walked), the root is bound onto
itself (pivot_root refuses the copied, locked mount), /proc and sysfs mounted, and pivoted.

Nothing else of the host is there to reach: not DSEC_HOME's keys, databases or sandboxes, not
other checkouts, not /var/tmp, not a PostgreSQL socket, and no network but a loopback of its
own. Mounts made inside (buildah's overlays) live and die with the namespace, and a process
that gets out of buildah is an unprivileged host uid.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dsec.native import compile_static
from dsec.types import Unavailable

ETC_FILES = ("passwd", "group", "nsswitch.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
             "alternatives", "containers", "localtime")
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
TOP_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

log = logging.getLogger("dsec.images.build_jail")


@dataclass(frozen=True)
class IdRange:
    """One line of the user namespace's uid and gid maps."""
    inside: int
    outside: int            # the host id `inside` is
    count: int


@dataclass(frozen=True)
class Bind:
    path: Path              # the same path inside as outside
    writable: bool = False


@contextmanager
def build_cgroups(name: str, memory_mb: int, pids: int) -> Iterator[list[Path]]:
    """Cgroups (one per hierarchy: v2, or v1's memory and pids) that charge a whole build --
    buildah and its RUN steps -- with memory and pids limits; `jailed(cgroups=...)` puts the
    command tree there. Made by the host: crun, root of buildah's user namespace only, may not
    make or limit cgroups (it runs RUN steps without any of its own). Removed afterwards."""
    cg = Path("/sys/fs/cgroup")
    mem, pid = str(memory_mb << 20), str(pids)
    if (cg / "cgroup.controllers").exists():
        parents = {cg / "dsec-build": {"cgroup.subtree_control": "+memory +pids"}}
        leaves = {cg / "dsec-build" / name: {"memory.max": mem, "memory.swap.max": "0", "pids.max": pid}}
    else:
        parents = {cg / c / "dsec-build": {} for c in ("memory", "pids")}
        leaves = {cg / "memory" / "dsec-build" / name: {"memory.limit_in_bytes": mem},
                  cg / "pids" / "dsec-build" / name: {"pids.max": pid}}
    try:
        try:
            for d, values in [*parents.items(), *leaves.items()]:
                d.mkdir(exist_ok=True)
                d.chmod(0o755)        # not the server's umask: RUN steps read their limits here
                for k, v in values.items():
                    if (d / k).exists():
                        (d / k).write_text(v)
        except OSError as e:
            raise Unavailable(f"cannot make the build's cgroup {e.filename}: {e.strerror}",
                              fix="builds need the memory and pids cgroup controllers (cgroup v2: "
                                  "enabled in the root's cgroup.subtree_control)") from None
        yield list(leaves)
    finally:
        for d in leaves:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:     # a process still in it: the next build in the slot reuses it
                log.warning("could not remove the build cgroup %s: %s", d, e)


def userns_helper(bin_dir: Path) -> Path:
    """dsec-build-userns (userns_exec.c), compiled once per source version into `bin_dir`."""
    return compile_static(Path(__file__).with_name("userns_exec.c"), bin_dir, "dsec-build-userns")


def unshare_binary() -> str:
    path = shutil.which("unshare")
    if path is None:
        raise Unavailable("unshare (util-linux) is not installed; builds run in their own namespaces",
                          fix="apt-get install -y util-linux")
    return path


def _outer(root: Path, binds: Sequence[Bind], ns_root: int, cgroups: Sequence[Path]) -> str:
    """Run as host root in a new mount namespace: the jail's root tree, built with the host's
    privileges (binds of paths the namespace's root could not traverse), and the cgroups the
    whole build is charged to. Then `exec` into the user namespace ("$@")."""
    q = shlex.quote
    owned = f"uid={ns_root},gid={ns_root}"
    lines = ["set -eu", "umask 022", f"T={q(str(root))}",   # the server's umask is 077
             # the jail's root is T/root: the namespace's root walks there from T (cwd), not
             # through host directories it may not search (module doc)
             f'mount -t tmpfs -o mode=0700,nosuid,nodev,{owned} dsec-build-top "$T"', 'R="$T/root"',
             f'mkdir -m 0755 "$R" && chown {ns_root}:{ns_root} "$R"',
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
              "printf 'dsec-build\\n' > \"$R/etc/hostname\"",
              'mount -t tmpfs -o mode=0755,nosuid dsec-build-dev "$R/dev"',
              f'mkdir -p "$R/dev/shm" "$R/dev/pts" && mount -t tmpfs -o mode=1777,nosuid,nodev,{owned} shm "$R/dev/shm"']
    for node in DEV_NODES:
        if Path("/dev", node).exists():
            lines += [f'touch "$R/dev/{node}"', f'mount --bind /dev/{node} "$R/dev/{node}"']
    lines += ['ln -s /proc/self/fd "$R/dev/fd"',
              f'mount -t tmpfs -o mode=1777,nosuid,nodev,{owned} tmp "$R/tmp"',
              f'mount -t tmpfs -o mode=0755,nosuid,nodev,{owned} run "$R/run"']
    for b in sorted(binds, key=lambda b: len(b.path.parts)):       # parents before children
        inside = f'"$R"{q(str(b.path))}'
        lines += [f"mkdir -p {inside}", f"mount --bind {q(str(b.path))} {inside}"]
        if not b.writable:
            lines.append(f"mount -o remount,bind,ro {inside}")
    for cg in cgroups:           # this shell, and so everything it execs, is charged there
        lines.append(f"echo $$ > {q(str(cg / 'cgroup.procs'))}")
    lines += ['cd "$T"', 'exec "$@"']
    return "\n".join(lines)


def _inner(cwd: Path | None) -> str:
    """Run as root of the user namespace, in the new mount, network, pid, IPC and UTS
    namespaces it owns, from the top of the jail's tmpfs (paths relative to it: mount -c):
    the mounts that need those namespaces, then pivot into the root."""
    q = shlex.quote
    return "\n".join([
        "set -eu", "hostname dsec-build",
        # the root as a mount of this namespace: pivot_root refuses the copied, locked one
        "mount -c --rbind root root", "cd -P root",
        "mount -c -t proc -o nosuid,nodev,noexec proc proc",
        # a sysfs of the new network namespace (the host's would list its interfaces)
        "mount -c -t sysfs -o ro,nosuid,nodev,noexec sysfs sys",
        "mount -c --rbind /sys/fs/cgroup sys/fs/cgroup",
        "pivot_root . .old", "umount -l /.old", "rmdir /.old",
        f"cd {q(str(cwd or '/'))}", 'exec "$@"'])


def jailed(argv: Sequence[str], *, root: Path, binds: Sequence[Bind], ids: Sequence[IdRange], helper: Path,
           cwd: Path | None = None, cgroups: Sequence[Path] = ()) -> list[str]:
    """argv run as root of a new user namespace (`ids`: its uid and gid maps, the first mapping
    0 to an unprivileged host id) and in new mount, network, pid, IPC and UTS namespaces it
    owns, whose root holds only the system's programs and `binds` (module doc). `root`: an
    empty host directory to build that root on (a private mount point: the host never sees
    what is mounted there). `helper`: userns_helper(). `cgroups`: cgroup directories (one per
    hierarchy) the whole command tree runs in."""
    root.mkdir(parents=True, exist_ok=True)
    if cwd is not None and not any(cwd == b.path or cwd.is_relative_to(b.path) for b in binds):
        raise ValueError(f"the build's working directory {cwd} is not among its binds")
    if not ids or ids[0].inside != 0 or ids[0].outside == 0 or any(r.outside == 0 for r in ids):
        raise ValueError("the build's user namespace must map 0, and only to unprivileged host ids")
    unshare = unshare_binary()
    maps = [a for r in ids for a in ("-m", f"{r.inside}:{r.outside}:{r.count}")]
    return [unshare, "--mount", "--propagation", "private", "--",
            "/bin/sh", "-c", _outer(root, binds, ids[0].outside, cgroups), "dsec-build-outer",
            str(helper), "-r", str(ids[0].outside), *maps, "--",
            unshare, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child=SIGKILL",
            "--propagation", "private", "--",
            "/bin/sh", "-c", _inner(cwd), "dsec-build-jail", *argv]
