"""The OCI runtime config (config.json) of a container sandbox, built as plain data.

The sandbox is described by one declarative document that crun realises; tests assert on it.
"""

from __future__ import annotations

import functools
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.container import qos
from dsec.backends.container.lxcfs import VIEW_FILES
from dsec.pkgcache.apt import CONF_DIR_IN_SANDBOX as APT_CONF_DIR, CONF_NAME as APT_CONF_NAME
from dsec.security.profile import CAPABILITIES, MASKED_PATHS, READONLY_PATHS
from dsec.security.seccomp import seccomp_profile
from dsec.security.egress_ca import BUNDLE_IN_SANDBOX

AGENT_DIR_IN_SANDBOX = "/.dsec"
AGENT_PATH_IN_SANDBOX = "/.dsec/agent"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class ContainerSpec:
    """What the container driver needs to know, decided by the edge."""

    sandbox_id: str
    lower_dirs: list[Path]          # mounted EROFS layers, base first
    cpu_cores: float
    memory_mb: int
    pids_limit: int
    uid: int
    gid: int
    workdir: str
    hostname: str = "sandbox"
    network: tuple = ()             # resolved egress allow-list (dsec.security.netpolicy.Allow)
    disk_mb: int = 10240            # writable-layer quota (disk.py)
    nofile: int = 4096              # RLIMIT_NOFILE of every command (soft = hard)
    max_file_mb: int | None = None  # RLIMIT_FSIZE of every command; None: unlimited
    id_base: int | None = None      # host uid/gid of root inside (own user namespace); None: no userns
    id_count: int = 65536           # ids mapped: 0..id_count-1 inside -> id_base.. on the host
    userns_path: str | None = None  # the user namespace to join (made by nsexec.c, owned by id_base)
    cpu_class: str = "latency"      # CPU QoS class (qos.py): 'latency' or 'batch' (best effort)
    resolv_conf: str | None = None  # host file bound read-only on /etc/resolv.conf (network.py)
    ca_bundle: str | None = None    # host file bound read-only where SSL_CERT_FILE points (secrets)
    apt_conf: str | None = None     # host file bound read-only in /etc/apt/apt.conf.d (package cache)
    cpus: str = ""                  # its cpuset ("0,1", cpusets.py); "": every CPU of the host
    snapshot: str | None = None     # the snapshot its filesystem starts from (snapshots.py)
    snap_lowers: tuple = ()         # [layer dir, disk id base] of that snapshot's chain, oldest first
    # volumes (dsec.volumes): (host directory, path inside, read-only); with a user namespace
    # nsexec attaches an idmapped clone of each at VOLUME_STAGING/N, which crun binds at the path
    volumes: tuple[tuple[str, str, bool], ...] = ()


# DSEC_CGROUP_PARENT: one per process (the driver sets it at start), read by every cgroup path
_cgroup_parent = "/dsec"


def set_cgroup_parent(parent: str) -> None:
    global _cgroup_parent
    _cgroup_parent = parent.rstrip("/") or "/dsec"


def cgroup_path(sandbox_id: str) -> str:
    return f"{_cgroup_parent}/{sandbox_id}"


def retained_output_bytes(memory_mb: int) -> int:
    """What the agent (charged to the sandbox's memory) may keep of finished, unreleased execs'
    output (its -R): a quarter of the sandbox's memory, 1..64 MiB. The edge releases each result
    once delivered; this bounds the ones nobody collected (a client gone mid-stream)."""
    return max(1 << 20, min(64 << 20, (memory_mb << 20) // 4))


# Kernel memory a sandbox makes the host hold outside its own pages (docs/security.md, "Kernel
# memory"). Socket buffers: cgroup v2 charges them to memory.max; v1 only to the global tcp_mem
# (one 128 MiB sandbox held 402 MB of loopback buffers), unless the cgroup has a kmem.tcp limit,
# which also turns on the per-cgroup accounting (for TCP and UDP: every socket the sandbox
# creates afterwards). Per socket, the sandbox's own netns gets the kernel's default buffer
# ceilings instead of a copy of the host's (often raised) ones.
SOCKET_SYSCTLS = {"net.ipv4.tcp_rmem": "4096 131072 6291456", "net.ipv4.tcp_wmem": "4096 16384 4194304"}


def tcp_mem_bytes(memory_mb: int) -> int:
    """cgroup v1: socket buffer memory a sandbox may hold (memory.kmem.tcp.limit_in_bytes): a
    quarter of its memory limit, at least 16 MiB (a few busy connections), at most the limit."""
    mem = memory_mb << 20
    return min(mem, max(16 << 20, mem // 4))


def node_file_max(mem_total_bytes: int) -> int:
    """fs.file-max the node needs: every struct file is charged to the memory cgroup of whoever
    opens it (filp slab, ~230 B), so a sandbox's files are bounded by its memory limit. The
    kernel's default (one file per ~10 KiB of RAM) is a count that one sandbox of a quarter of
    the node's memory could exhaust (ENFILE for every other unprivileged process). Sized so the
    files of all the memory there is (at 128 B each, below the real cost) fit: memory, charged
    per sandbox, runs out first. systemd hosts have LONG_MAX already."""
    return mem_total_bytes // 128


def ensure_node_file_max() -> None:
    """Raise fs.file-max to node_file_max() (never lowers it); the driver does it at start."""
    try:
        mem_total = next(int(line.split()[1]) << 10 for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemTotal:"))
        p = Path("/proc/sys/fs/file-max")
        want = node_file_max(mem_total)
        if int(p.read_text()) < want:
            p.write_text(str(want))
    except (OSError, ValueError, StopIteration):
        pass     # not root, or a read-only /proc/sys: memory still bounds each sandbox's files


# Masked directories get a read-only bind of one empty host directory rather than crun's tmpfs
# per directory: each tmpfs is a superblock per sandbox, every superblock a memcg-aware shrinker,
# and each memory cgroup keeps a map sized by the highest shrinker id (~1 KiB per 64 ids): at
# 3,200 sandboxes with 11 superblocks each that map was ~550 KiB per sandbox (D35). Files stay
# in maskedPaths (crun binds /dev/null over them: no superblock).
MASK_DIR_NAME = "mask-empty"


def mask_dir(agent_binary: Path) -> Path:
    """The empty directory bound over masked directories (beside the agent binary, which the
    sandbox's unprivileged init can already reach; made by the driver)."""
    return agent_binary.parent / MASK_DIR_NAME


AGENT_DIR_NAME = "dsec-root"


def dsec_dir(agent_binary: Path) -> Path:
    """The directory bound read-only at /.dsec: it holds only the empty file the agent binary is
    bound onto, so no process in the sandbox can add anything beside it (made by the driver)."""
    return agent_binary.parent / AGENT_DIR_NAME


@functools.cache
def masked_dirs() -> tuple[str, ...]:
    """Masked paths that are directories on this kernel (absent ones need no mask: crun skips
    them, and a bind onto a path procfs or sysfs lacks would fail the start)."""
    return tuple(p for p in MASKED_PATHS if os.path.isdir(p) and not os.path.islink(p))


def view_mounts(view: Path | None) -> list[dict]:
    """Read-only binds of lxcfs's files (lxcfs.py) over the sandbox's own /proc/meminfo,
    /proc/cpuinfo, ...: the figures of the reader's cgroups. Files only, never the lxcfs mount's
    directories (its cgroup/ tree shows the host's); binds add no superblock (D35)."""
    if view is None:
        return []
    return [{"destination": "/" + f, "type": "bind", "source": str(view / f),
             "options": ["bind", "ro", "nosuid", "nodev", "noexec"]} for f in VIEW_FILES]


VOLUME_STAGING = "vol"      # bundle subdirectory of the volumes' idmapped clones (nsexec -l)


def volume_mounts(spec: ContainerSpec, bundle: Path | None) -> list[dict]:
    """Binds of the sandbox's volumes. With its own user namespace (bundle given) the source is
    the idmapped clone nsexec attached in the private mount namespace: files on the volume
    keep in-sandbox ids (uid 1000 on disk is uid 1000 in every sandbox), each sandbox's host
    range seen through its own mapping, never a chown. nosuid/nodev: a volume is data."""
    out = []
    for i, (host, path, ro) in enumerate(spec.volumes):
        src = str(bundle / VOLUME_STAGING / str(i)) if bundle is not None and spec.id_base is not None else host
        out.append({"destination": path, "type": "bind", "source": src,
                    "options": ["bind", "nosuid", "nodev", "ro" if ro else "rw"]})
    return out


def build_config(spec: ContainerSpec, agent_binary: Path, *, cgroup_v2: bool,
                 quota_floor: float = qos.DEFAULT_QUOTA_FLOOR_CORES, view: Path | None = None,
                 bundle: Path | None = None) -> dict:
    mem = spec.memory_mb * 1024 * 1024
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 65536)
    namespaces = [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]
    if cgroup_v2:
        namespaces.append({"type": "cgroup"})
    linux_user: dict = {}
    if spec.id_base is not None:
        # Own user namespace: root inside is host uid id_base (unprivileged), and per-user kernel
        # limits are per sandbox. The lowers are idmapped to match (nsexec.c, idmap.py).
        # Joined, not created: nsexec makes it as host uid id_base so that the kernel's per-user
        # counts at host level are charged to this sandbox's range, not to host root.
        namespaces.append({"type": "user", **({"path": spec.userns_path} if spec.userns_path else {})})
        m = [{"containerID": 0, "hostID": spec.id_base, "size": spec.id_count}]
        linux_user = {"uidMappings": m, "gidMappings": m}
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            # The agent starts as root inside the sandbox so it can run each command as the
            # sandbox's user (non-root by default); commands get no capabilities unless root.
            "user": {"uid": 0, "gid": 0},
            # The agent confines every command with Landlock (its own domain per exec/session)
            # and sets the per-command limits below (dsec-agent.c, docs/agent-protocol.md).
            "args": [AGENT_PATH_IN_SANDBOX, "-w", spec.workdir, "-u", str(spec.uid), "-g", str(spec.gid),
                     "-n", str(spec.nofile), "-F", str((spec.max_file_mb or 0) << 20),
                     "-R", str(retained_output_bytes(spec.memory_mb))],
            "env": [f"PATH={DEFAULT_PATH}", "LANG=C.UTF-8"],
            "cwd": "/",
            "capabilities": {k: list(CAPABILITIES) for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile},
                        {"type": "RLIMIT_CORE", "hard": 0, "soft": 0}, *qos.rlimits(spec.cpu_class)],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            # /proc, /dev (after crun made its nodes), /sys and /.dsec are read-only mounts, and
            # what is writable below /dev is noexec: the agent then grants commands every
            # filesystem right on / itself, as in Docker (D11; base.c, ll_root_ok).
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k", "ro"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={min(mem, 256 << 20)}"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": AGENT_DIR_IN_SANDBOX, "type": "bind", "source": str(dsec_dir(agent_binary)),
             "options": ["bind", "ro", "nosuid", "nodev", "noexec"]},
            {"destination": AGENT_PATH_IN_SANDBOX, "type": "bind", "source": str(agent_binary),
             "options": ["bind", "ro", "nosuid", "nodev"]},
            *({"destination": d, "type": "bind", "source": str(mask_dir(agent_binary)),
               "options": ["bind", "ro", "nosuid", "nodev", "noexec"]} for d in masked_dirs()),
            # the node's DNS forwarder (answers only when the sandbox's policy allows egress)
            *([{"destination": "/etc/resolv.conf", "type": "bind", "source": spec.resolv_conf,
                "options": ["bind", "ro", "nosuid", "nodev", "noexec"]}] if spec.resolv_conf else []),
            # public roots + the node's egress CA, for sandboxes with secret rules (egress_ca.py)
            *([{"destination": BUNDLE_IN_SANDBOX, "type": "bind", "source": spec.ca_bundle,
                "options": ["bind", "ro", "nosuid", "nodev", "noexec"]}] if spec.ca_bundle else []),
            # apt's proxy: the node's package cache (pkgcache/apt.py), in Debian-based images
            *([{"destination": f"{APT_CONF_DIR}/{APT_CONF_NAME}", "type": "bind", "source": spec.apt_conf,
                "options": ["bind", "ro", "nosuid", "nodev", "noexec"]}] if spec.apt_conf else []),
            *view_mounts(view),
            *volume_mounts(spec, bundle),
        ],
        "linux": {
            "namespaces": namespaces,
            **linux_user,
            "cgroupsPath": cgroup_path(spec.sandbox_id),
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                # swap == limit: no swap while running; v1: socket buffers bounded (above)
                "memory": {"limit": mem, "swap": mem,
                           **({} if cgroup_v2 else {"kernelTCP": tcp_mem_bytes(spec.memory_mb)})},
                "cpu": {"quota": qos.cpu_quota_us(spec.cpu_cores, quota_floor), "period": qos.CPU_PERIOD_US,
                        "shares": qos.cpu_shares(spec.cpu_class, spec.cpu_cores),
                        **({"cpus": spec.cpus} if spec.cpus else {})},
                "pids": {"limit": spec.pids_limit},
            },
            "sysctl": dict(SOCKET_SYSCTLS),    # written by crun in the sandbox's own netns
            "seccomp": seccomp_profile(),
            "maskedPaths": [p for p in MASKED_PATHS if p not in masked_dirs()],
            "readonlyPaths": list(READONLY_PATHS),
        },
    }
