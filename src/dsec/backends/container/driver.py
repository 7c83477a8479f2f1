"""Container backend: crun over an overlay of read-only EROFS layers.

Per sandbox, under <home>/sb/<id>/: `upper` and `work` (the writable layer, on local disk),
`rootfs` (mountpoint; the overlay is mounted there only inside a private mount namespace, see
nsexec.c), `run/agent.sock` (the agent's listening socket, never visible inside the sandbox),
`run/init.log` (crun's and the agent's own stderr) and `config.json`. With user namespaces
(default; DSEC_USERNS=0 turns them off) also `lower/N`: mountpoints for the idmapped clones of
the layer mounts, used only inside the private mount namespace (nsexec.c, idmap.py).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from dsec import procstat
from dsec.backends.base import (PARKED, RUNNING, Backend, Egress, EgressSecrets, Hibernation, ImageStacks, LayerDiff, MemoryUsage,
                                Parking, PortIngress, Prepared, RawUsage, Reclaim, SnapshotLayers, Snapshots, UpperView,
                                UsageStats)
from dsec.backends.container import cgroups, hibernate, qos
from dsec.backends.container.crun_bin import crun_binary
from dsec.backends.container.seccomp_bpf import CompiledFilters
from dsec.backends.container import usage as usage_reader
from dsec.backends.container import claim as warm_claim
from dsec.backends.container.cpusets import CpuSets
from dsec.backends.container.disk import open_quotas
from dsec.backends.container.lxcfs import Lxcfs
from dsec.backends.container.idmap import IdRanges, host_to_sandbox
from dsec.backends.container.network import NetSettings, SandboxNetworks
from dsec.backends.container.parking import PARKED_MARKER, CgroupParking, cgroup_gone
from dsec.backends.container.ports import CONNECT_TIMEOUT_S, connect_in_netns
from dsec.backends.container.snapshots import ContainerSnapshots
from dsec.backends.container.spawn import run_to_exit
from dsec.backends.warm import WarmClaim
from dsec.backends.container.volumes import ContainerVolumeDirs
from dsec.backends.container.spec import (VOLUME_STAGING, ContainerSpec, build_config, cgroup_path, dsec_dir,
                                         ensure_node_file_max, mask_dir, set_cgroup_parent)
from dsec.config import Paths
from dsec.native import compile_static
from dsec.security.users import resolve_user
from dsec.security.netpolicy import Rulesets, resolve, tunnel_of
from dsec.settings import Settings
from dsec.types import ContainerArgs, InvalidArgument, NetworkPolicy, NetworkRuleSet, SandboxArgs, SandboxFailed, Unavailable

log = logging.getLogger("dsec.backends.container")

NSEXEC_SOURCE = Path(__file__).with_name("nsexec.c")

# PIDFD_GET_INFO (Linux 6.15+): the exit status of a pidfd's process once it has been reaped
# (_IOWR(0xFF, 11, struct pidfd_info), its first 64-byte version; exit_code at offset 60).
PIDFD_INFO_EXIT = 1 << 3
PIDFD_GET_INFO = (3 << 30) | (64 << 16) | (0xFF << 8) | 11

VIEW_RESTART_MIN_S = 2.0     # between two starts of the node's lxcfs (lxcfs.py)
SETTLE_S = 0.25              # a park to disk waits this long for ended commands' supervisors
DISK_WALK_EVERY_S = 60.0     # usage(): the writable layer is walked at most this often


@dataclass
class _ExitWatch:
    """A pidfd on a sandbox's init (the agent), registered with the event loop."""

    pid: int
    pidfd: int
    start: str                    # its start time (stat field 22): the same process, not a reused pid
    on_exit: Callable[[], None]
    fired: bool = False
    status: int | None = None     # wait status once it exited (None: unknown)


class ContainerDriver(Backend, LayerDiff, Egress, EgressSecrets, PortIngress, Parking, Hibernation, MemoryUsage, UsageStats, Reclaim,
                      WarmClaim, Snapshots, SnapshotLayers, ContainerVolumeDirs):
    kinds = ("container",)
    fresh_agent_at_create = True      # crun starts a new agent every time (snapshots are files only)
    instead = {"console": "read a container's output from its commands"}

    def __init__(self, paths: Paths, agent_binary: Path, rulesets: Rulesets, crun: str = "crun",
                 conf: Settings | None = None):
        self.paths = paths
        conf = conf or Settings()         # the composition root's (dsec.settings)
        self.quota_floor = conf.containers.cpu_quota_floor_cores   # DSEC_CPU_QUOTA_FLOOR_CORES
        set_cgroup_parent(conf.containers.cgroup_parent)            # DSEC_CGROUP_PARENT
        self.rulesets = rulesets      # the operator's named network rule sets
        self.agent_binary = agent_binary
        _make_mask_dir(mask_dir(agent_binary))
        _make_dsec_dir(dsec_dir(agent_binary))
        self.crun = crun_binary(crun)      # the node's read-only bind of crun if any (crun_bin.py)
        self.filters = CompiledFilters(self.crun)   # crun's seccomp filter, compiled once (seccomp_bpf.py)
        self.nsexec = compile_static(NSEXEC_SOURCE, paths.bin, "dsec-nsexec")
        self.cgroup_v2 = cgroups.is_unified()
        self.cpuset_v1 = cgroups.cpuset_v1_root()   # made before crun, balancing off (cgroups.py)
        problem = cgroups.check_host()
        if problem:
            raise Unavailable(problem, fix=problem)
        if (slow := cgroups.dynmods_problem()) is not None:
            log.warning(slow, extra={"fix": "run scripts/host-setup.sh (remounts the cgroup v2 hierarchy with favordynmods)"})
        ensure_node_file_max()   # node-wide: sandboxes' files are bounded by their memory instead
        # per-sandbox egress policy (cgroup-BPF) and, when a policy allows anything, a veth
        self.net = SandboxNetworks(paths, lambda sid: cgroups.v2_dir(cgroup_path(sid)),
                                   NetSettings.of(conf.network))
        # writable-layer quota: sandbox dirs are btrfs subvolumes with a limit (or polled)
        self.disk = open_quotas(paths, conf.storage)
        self.snaps = ContainerSnapshots(paths.sandboxes, self.disk)   # snapshots and forks (snapshots.py)
        self.volumes_dir = conf.storage.volumes_dir     # volumes.py: "" keeps them in the scratch
        # a user namespace per sandbox with its own host id range (idmap.py)
        c = conf.containers
        self.ids = IdRanges(c.idmap_registry, c.idmap_first, c.idmap_slots) if c.userns else None
        self._watches: dict[str, _ExitWatch] = {}     # exit detection (watch_exit)
        self.parking = CgroupParking(self.cgroup_v2)  # suspend: freeze + memory to (zram) swap
        self._disk_seen: dict[str, tuple[float, int]] = {}   # usage(): when each layer was last walked, bytes
        # suspend of a quiescent container: torn down to its files, started again on resume
        self.park_to_disk = c.park_to_disk
        # sandboxes see their own size (D50): a cpuset each, lxcfs's /proc files bound in
        self.cpusets = CpuSets() if c.cpuset else None
        self.lxcfs = Lxcfs(paths.home / "lxcfs") if c.lxcfs else None
        self.view: Path | None = None          # the lxcfs mountpoint while its daemon answers
        self._view_pidfd: int | None = None
        self._view_restarted = False           # started here: binds made before need repair
        self._view_tasks: set[asyncio.Task[None]] = set()
        self._view_started_at = 0.0
        self._view_gen = 0                     # daemons started by this edge: a create that
                                               # straddles a restart repairs its own binds
        if self.lxcfs is not None:
            try:
                _, self._view_restarted = self.lxcfs.ensure()
                self.view = self.lxcfs.mountpoint
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("sandboxes will read the host's /proc/meminfo and CPUs: %s", e,
                            extra={"fix": "apt-get install lxcfs (scripts/install.sh); or DSEC_LXCFS=0"})

    # -- paths ---------------------------------------------------------------------------
    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.paths.sandboxes / sandbox_id

    def agent_socket(self, sandbox_id: str) -> Path:
        return self.sandbox_dir(sandbox_id) / "run" / "agent.sock"

    def _crun(self, *args: str) -> list[str]:
        return [self.crun, "--root", str(self.paths.crun_root), *args]

    # -- lifecycle -----------------------------------------------------------------------
    async def prepare(self, args: SandboxArgs, images: ImageStacks) -> Prepared:
        assert isinstance(args, ContainerArgs)
        if args.snapshot is not None:
            args = await asyncio.to_thread(self._from_snapshot, args)
        stack = await images.stack(args)                 # NotFound names the field
        uid, gid = resolve_user(args.user)
        allows = resolve(args.network, self.rulesets)   # 422 for unknown rule sets, before anything exists
        # pip and npm ask the node's package cache; the user's env wins. Only sandboxes that can
        # reach it get it: with no egress or a SOCKS tunnel the env would point pip at a wall.
        cache_env = self.net.sandbox_env() if allows and tunnel_of(allows) is None else {}
        if cache_env and any(k not in args.env for k in cache_env):
            args = args.model_copy(update={"env": {**cache_env, **args.env}})
        return Prepared(args=args, image_digest=stack[0].digest, uid=uid, gid=gid, plan=stack, allows=allows)

    async def create(self, sandbox_id: str, prepared: Prepared, images: ImageStacks) -> None:
        args = prepared.args
        assert isinstance(args, ContainerArgs)
        lower = await images.mounted_lowers(prepared.plan)
        spec = ContainerSpec(sandbox_id=sandbox_id, lower_dirs=lower, cpu_cores=args.cpu_cores,
                             memory_mb=args.memory_mb, pids_limit=args.pids_limit, uid=prepared.uid,
                             gid=prepared.gid, workdir=args.workdir, network=tuple(prepared.allows),
                             resolv_conf=str(self.net.resolv_conf()),
                             ca_bundle=str(self._ca_bundle()) if args.secrets else None,
                             apt_conf=self._apt_conf(prepared.allows, lower),
                             disk_mb=args.disk_mb, nofile=args.nofile, max_file_mb=args.max_file_mb,
                             cpu_class=args.cpu_class, snapshot=args.snapshot, volumes=tuple(prepared.volumes),
                             cpus=self.cpusets.pick(sandbox_id, args.cpu_cores) if self.cpusets else "")
        await self._start(sandbox_id, spec)

    def _apt_conf(self, allows: list, lower: list) -> str | None:
        """apt's proxy setting naming the package cache, for the sandboxes that get its env
        (prepare) and whose image has apt (/etc/apt/apt.conf.d): others get no new file."""
        if not allows or tunnel_of(allows) is not None:
            return None
        if not any((Path(d) / "etc" / "apt" / "apt.conf.d").is_dir() for d in lower):
            return None
        path = self.net.apt_conf()
        return str(path) if path is not None else None

    async def _start(self, sandbox_id: str, spec: ContainerSpec) -> None:
        d = self.sandbox_dir(sandbox_id)
        self._watch_view()
        gen = self._view_gen
        try:
            try:
                spec = await asyncio.to_thread(self._prepare_bundle, d, spec)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                    raise
                # btrfs can refuse a new subvolume (metadata full) while statvfs still shows room
                raise Unavailable(f"node's sandboxes' scratch filesystem ({self.paths.sandboxes}) cannot take a new "
                                  f"sandbox: {e.strerror} (admission keeps DSEC_SCRATCH_RESERVE_MB free; this "
                                  "create got past it)", field=None,
                                  fix="stop idle sandboxes or delete files in them, or raise DSEC_SCRATCH_GB; "
                                      "retry (placement tries another node)") from e
            listener = self._listen(self.agent_socket(sandbox_id))
            try:
                pid = await self._run_crun(sandbox_id, d, spec, listener)
            finally:
                listener.close()  # the agent holds its own copy (fd 3)
            if not self.filters.known:     # the first start: keep the filter crun compiled
                await asyncio.to_thread(self._learn_filter, d, sandbox_id)
            await self.net.setup(sandbox_id, pid, list(spec.network))
            if gen != self._view_gen:        # lxcfs restarted meanwhile: its binds may be the dead one's
                await self._rebind_views([sandbox_id])
            # what a park to disk needs to start it again, and to see that nothing changed
            await asyncio.to_thread(self._record_start, d / "run", spec, pid)
        except BaseException:
            await asyncio.shield(self.destroy(sandbox_id))
            raise

    def _learn_filter(self, d: Path, sandbox_id: str) -> None:
        # never fails a create: without a kept filter crun compiles it, as before
        try:
            self.filters.learn(json.loads((d / "config.json").read_text()), self.paths.crun_root / sandbox_id)
        except (OSError, ValueError) as e:
            log.warning("crun's compiled seccomp filter not kept", extra={"sandbox": sandbox_id, "error": str(e)})

    @staticmethod
    def _record_start(run: Path, spec: ContainerSpec, pid: int) -> None:
        hibernate.save_spec(run, spec)
        hibernate.record_dev(pid, run)

    def _prepare_bundle(self, d: Path, spec: ContainerSpec) -> ContainerSpec:
        self.disk.create_dir(d, spec.disk_mb << 20)   # mode 0700; a quota'd subvolume if possible
        for sub in ("upper", "work", "rootfs", "run"):
            (d / sub).mkdir(mode=0o700)
        # overlay needs the upper root to be traversable by the sandbox user
        os.chmod(d / "upper", 0o755)
        if spec.snapshot is not None:   # the snapshot's layers, held for as long as this sandbox lives
            chain = self.snaps.use(spec.snapshot, d)
            spec = replace(spec, snap_lowers=tuple([str(self.snaps.layer(sid)), base] for sid, base in chain))
        if self.ids is not None:
            # claimed only now that d exists: a claim whose directory is gone counts as stale
            spec = replace(spec, id_base=self.ids.allocate(d), userns_path=str(d / "run" / "userns"))
            (d / "run" / "userns").touch(mode=0o600)   # bind-mount target (nsexec -N)
            # the upper root is the sandbox's "/": owned by its root, i.e. the range's first id
            os.chown(d / "upper", spec.id_base, spec.id_base)
            # crun's init runs as that unprivileged host uid: it must traverse the bundle dir
            # to reach rootfs (the dirs inside stay 0700; nothing in the sandbox sees host paths)
            os.chmod(d, 0o711)
            (d / "lower").mkdir(mode=0o700)
            for i in range(len(spec.lower_dirs)):
                (d / "lower" / str(i)).mkdir(mode=0o700)
            for i in range(len(spec.snap_lowers)):
                (d / "lower" / f"s{i}").mkdir(mode=0o700)
            if spec.volumes:     # crun's unprivileged init binds from here: traversable
                (d / VOLUME_STAGING).mkdir(mode=0o711)
            for i in range(len(spec.volumes)):
                (d / VOLUME_STAGING / str(i)).mkdir(mode=0o700)
        cfg = build_config(spec, self.agent_binary, cgroup_v2=self.cgroup_v2, quota_floor=self.quota_floor,
                               view=self.view, bundle=d)
        self.filters.annotate(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        self._precreate_cgroups(spec.sandbox_id)
        return spec

    def _precreate_cgroups(self, sandbox_id: str) -> None:
        """What crun's cgroup set-up would do in O(live sandboxes) done first in O(1) (cgroups.py)."""
        if self.cpuset_v1 is not None:
            cgroups.precreate_cpuset_v1(self.cpuset_v1, cgroup_path(sandbox_id))

    @staticmethod
    def _listen(path: Path) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(str(path))
            os.chmod(path, 0o600)
            s.listen(16)
        except BaseException:
            s.close()
            raise
        return s

    async def _run_crun(self, sandbox_id: str, d: Path, spec: ContainerSpec,
                        listener: socket.socket) -> int:
        """Start the container; the host pid of its init (the agent), read once from crun's pid file."""
        idmapped: list[str] = []
        lowers = [str(p) for p in spec.lower_dirs]
        if spec.id_base is not None:
            # nsexec attaches an idmapped clone of each layer at lower/N and overlays those
            targets = [str(d / "lower" / str(i)) for i in range(len(lowers))]
            idmapped = ["-u", str(spec.id_base), "-N", str(spec.userns_path)]
            for src, dst in zip(lowers, targets):
                idmapped += ["-l", f"{src}:{dst}"]
            for i, (host, _, _) in enumerate(spec.volumes):      # spec.volume_mounts binds these
                idmapped += ["-v", f"{host}:{d / VOLUME_STAGING / str(i)}"]
            lowers = targets
            # a snapshot's layer holds its source's host ids: shown shifted into this range (nsexec -s)
            for i, (src, base) in enumerate(spec.snap_lowers):
                dst = str(d / "lower" / f"s{i}")
                idmapped += ["-s", f"{base if base is not None else 0}:{src}:{dst}"]
                lowers.append(dst)
        else:
            lowers += [src for src, _ in spec.snap_lowers]
        lower = ":".join(reversed(lowers))  # overlay wants top first
        opts = f"lowerdir={lower},upperdir={d / 'upper'},workdir={d / 'work'}"
        fd = listener.fileno()
        argv = [str(self.nsexec), "-o", opts, "-t", str(d / "rootfs"), "-f", str(fd), *idmapped, "--",
                *self._crun("run", "-d", "--preserve-fds", "1", "--pid-file", str(d / "run" / "pid"),
                            "--bundle", str(d), sandbox_id)]
        with open(d / "run" / "init.log", "ab") as logf:
            # umask 022, not the server's private 077: what crun creates inside the rootfs
            # (mountpoints such as /.dsec, /proc, /dev) must be usable by the sandbox's own root
            rc = await run_to_exit(argv, stdout=logf.fileno(), stderr=logf.fileno(), pass_fds=(fd,), umask=0o022)
        if rc != 0:
            tail = (d / "run" / "init.log").read_bytes()[-2000:].decode(errors="replace").strip()
            raise SandboxFailed(f"crun could not start sandbox {sandbox_id} (exit {rc}): {tail}",
                                fix="check the image and limits; see the edge log")
        # No oom_score_adj for the agent (D11): /proc is read-only inside, so its commands could
        # not reset what they inherit, and every process of the sandbox would be the host's
        # OOM killer's last choice too.
        # CPU QoS class (qos.py): set on the agent before any command, inherited by all of them
        pid = self._pid(sandbox_id)
        qos.apply(spec.cpu_class, pid, cgroup_path(sandbox_id), v2=self.cgroup_v2)
        return pid

    async def destroy(self, sandbox_id: str) -> None:
        self.unwatch_exit(sandbox_id)     # its death below is ours, not news for the edge
        self._disk_seen.pop(sandbox_id, None)
        d = self.sandbox_dir(sandbox_id)
        on_disk = hibernate.on_disk(d / "run")   # parked to disk: no runtime, no pid file
        killed = d.exists() and not (d / "run" / "pid").exists() and not on_disk
        if killed:
            await asyncio.to_thread(_kill_inflight_create, d)
        rc, err = await self._crun_delete(sandbox_id)
        unknown = b"does not exist" in err or b"No such file" in err
        if rc != 0 and not unknown:
            log.warning("crun delete failed", extra={"sandbox": sandbox_id, "stderr": err.decode(errors="replace")})
        if unknown and not killed and d.exists() and not on_disk:
            # crun has no state for it, yet its bundle is here: a `crun run` may still be
            # creating it (the edge died mid-create after the pid file was written)
            await asyncio.to_thread(_kill_inflight_create, d)
        # cgroups that crun could not remove (e.g. it died mid-create) are removed here
        await asyncio.to_thread(_remove_cgroups, sandbox_id)
        base = self.id_base(sandbox_id)
        if d.exists():
            await asyncio.to_thread(self.snaps.release, d)   # before its chain record goes with d
            await asyncio.to_thread(self.disk.remove_dir, d)
        if base is not None and self.ids is not None:
            self.ids.release(base, d)   # after `crun delete`: no process of the range is left
        elif self.ids is not None:      # torn down before config.json recorded its base (a failed
            await asyncio.to_thread(self.ids.release_owner, d)   # or crashed create): by owner
        await self.net.release(sandbox_id)   # veth (if any), IP, BPF map entries
        self.net.secrets.drop(sandbox_id)    # gone for good (a park to disk keeps them: same edge)
        if self.cpusets is not None:
            self.cpusets.release(sandbox_id)

    async def _crun_delete(self, sandbox_id: str) -> tuple[int, bytes]:
        """`crun delete -f`: its exit status and stderr."""
        proc = await asyncio.create_subprocess_exec(
            *self._crun("delete", "-f", sandbox_id), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        return proc.returncode or 0, err

    def id_base(self, sandbox_id: str) -> int | None:
        """Host uid/gid of the sandbox's root (its user namespace's mapping, as crun was told
        in config.json, which survives edge restarts); None without a user namespace."""
        try:
            cfg = json.loads((self.sandbox_dir(sandbox_id) / "config.json").read_text())
            return int(cfg["linux"]["uidMappings"][0]["hostID"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None

    @property
    def disk_enforced(self) -> bool:   # type: ignore[override]
        """True when the kernel enforces disk_mb; else the edge polls `disk_usage`."""
        return self.disk.enforced

    def log_tail(self, sandbox_id: str) -> str:
        p = self.sandbox_dir(sandbox_id) / "run" / "init.log"
        try:
            tail = p.read_bytes()[-500:].decode(errors="replace").strip()
        except OSError:
            return ""
        return f" (init log: {tail})" if tail else ""

    @asynccontextmanager
    async def frozen_upper(self, sandbox_id: str) -> AsyncIterator[UpperView]:
        # Frozen while its upper dir is read on the host: otherwise the sandbox could swap a
        # directory for a symlink mid-walk and have host files copied into the layer.
        # A user-namespaced sandbox's upper holds host ids of its range: readers get the ids
        # as seen inside (root = 0), so a layer made of it works in any other sandbox.
        base = self.id_base(sandbox_id)
        map_id = functools.partial(host_to_sandbox, base=base) if base is not None else None
        # a fork's upper holds only what changed since its snapshot: the snapshot's layers (read
        # only, ids of their source's range) are packed too, below it
        below = tuple((self.snaps.layer(sid), functools.partial(host_to_sandbox, base=b) if b is not None else None)
                      for sid, b in self.snaps.chain_of(self.sandbox_dir(sandbox_id)))
        await self.pause(sandbox_id)
        try:
            yield UpperView(self.sandbox_dir(sandbox_id) / "upper", map_id, below)
        finally:
            await self.resume(sandbox_id)

    # -- snapshots and forks (snapshots.py) -------------------------------------------------
    def _from_snapshot(self, args: ContainerArgs) -> ContainerArgs:
        """The args a sandbox made from a snapshot runs with: its source's, but for what the
        request set itself (not the image: the snapshot's layers sit on the source's)."""
        assert args.snapshot is not None
        was = ContainerArgs.model_validate(self.snaps.meta(args.snapshot)["args"])
        given = {f: getattr(args, f) for f in args.model_fields_set if f not in ("image", "backend")}
        for f in ("env", "labels"):          # added to the snapshot's, not instead of them
            if f in given:
                given[f] = {**getattr(was, f), **given[f]}
        return was.model_copy(update={"idempotency_key": None, **given, "snapshot": args.snapshot})

    async def snapshot(self, sandbox_id: str, snapshot_id: str, meta: dict) -> int:
        """Its filesystem at this moment (frozen for the few ms of a btrfs snapshot, so files
        written together are kept together); it runs on unchanged. The bytes are measured on
        first listing (a walk), not here: a fork waits for nothing but the snapshot."""
        d = self.sandbox_dir(sandbox_id)
        if hibernate.on_disk(d / "run"):
            raise SandboxFailed(f"sandbox {sandbox_id} is parked to disk", fix="resume it first")
        meta = {**meta, "source": sandbox_id, "disk_base": self.id_base(sandbox_id)}
        await self.pause(sandbox_id)
        try:
            await asyncio.to_thread(self.snaps.take, d, snapshot_id, meta)
        finally:
            await self.resume(sandbox_id)
        return 0

    def snapshot_record(self, snapshot_id: str) -> dict:
        return self.snaps.record(snapshot_id)

    def snapshot_layers(self, snapshot_id: str) -> tuple[UpperView, dict]:
        """Its chain's layers, each with the id map of the range its source ran in (as
        frozen_upper gives a fork's): packed as they are, no sandbox needed."""
        meta = self.snaps.meta(snapshot_id)
        layers = [(self.snaps.layer(sid), functools.partial(host_to_sandbox, base=b) if b is not None else None)
                  for sid, b in meta["chain"]]
        (top, top_map), below = layers[-1], tuple(layers[:-1])
        return UpperView(top, top_map, below), meta

    def snapshot_records(self) -> list[dict]:
        return self.snaps.records()

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Unlisted at once; the files stay while a sandbox made from it runs (snapshots.py)."""
        await asyncio.to_thread(self.snaps.delete, snapshot_id)

    def disk_usage(self, sandbox_id: str) -> int:
        """Bytes in the sandbox's writable layer (a walk: for the polling fallback only)."""
        return self.disk.usage(self.sandbox_dir(sandbox_id) / "upper")

    def _pid(self, sandbox_id: str) -> int:
        """Host pid of the sandbox's agent (crun's --pid-file): the way into its namespaces."""
        return int((self.sandbox_dir(sandbox_id) / "run" / "pid").read_text())

    def _ca_bundle(self) -> Path:
        return self.net.egress_ca().bundle()

    async def set_egress_secrets(self, sandbox_id: str, rules: list) -> None:
        await self.net.set_secrets(sandbox_id, rules)

    def revoke_egress_secret(self, secret_id: str) -> int:
        return self.net.secrets.revoke(secret_id)

    async def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        """Replace a running sandbox's egress policy (BPF map update; first allow adds a veth)."""
        allows = resolve(policy, self.rulesets, field="")
        old, new = tunnel_of(self.net.allows_of(sandbox_id)), tunnel_of(allows)
        if new != old and new is not None:
            raise InvalidArgument(f"egress_proxy: sandbox {sandbox_id} " + (
                f"is tunnelled through {old}; the proxy is set at create only" if old else
                "was created without an egress proxy; it is set at create only"),
                field="egress_proxy", fix=f"repeat {old!r} or leave egress_proxy unset" if old
                else "create a new sandbox with network.egress_proxy")
        if old is not None and new is None:   # kept for the sandbox's life: never direct
            allows = [*allows, next(a for a in self.net.allows_of(sandbox_id) if a.is_tunnel)]
        await self.net.apply(sandbox_id, self._pid(sandbox_id), allows)

    def set_rulesets(self, sets: dict[str, NetworkRuleSet]) -> None:
        self.rulesets.write(sets)

    def known_rulesets(self) -> set[str]:
        return set(self.rulesets.get())

    # -- warm pools (dsec.backends.warm, claim.py) ----------------------------------------
    def warm_key(self, prepared: Prepared) -> Hashable | None:
        return warm_claim.warm_key(prepared, userns=self.ids is not None)

    async def claim(self, sandbox_id: str, prepared: Prepared) -> None:
        """A pre-started container gets the claimer's limits and network policy."""
        args = prepared.args
        assert isinstance(args, ContainerArgs)
        # placed again for its claimed cores: a pool container's cpuset was for the pool's
        cpus = self.cpusets.pick(sandbox_id, args.cpu_cores) if self.cpusets is not None else ""
        # a few cgroup file writes (microseconds): inline, a thread hop would cost more
        warm_claim.apply_limits(cgroup_path(sandbox_id), args, v2=self.cgroup_v2, quota_floor=self.quota_floor,
                                cpus=cpus)
        run = self.sandbox_dir(sandbox_id) / "run"     # a start after a park to disk: as claimed
        if (run / hibernate.SPEC_FILE).exists():
            hibernate.save_spec(run, replace(hibernate.load_spec(run), cpu_cores=args.cpu_cores,
                                             memory_mb=args.memory_mb, pids_limit=args.pids_limit, cpus=cpus))
        if prepared.allows:
            await self.net.apply(sandbox_id, self._pid(sandbox_id), list(prepared.allows))

    async def open_port(self, sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to `port` on the sandbox's loopback, made from the host side into
        its network namespace (ports.py): its egress policy does not apply, by design."""
        try:
            pid = self._pid(sandbox_id)
        except (OSError, ValueError):
            raise FileNotFoundError(f"sandbox {sandbox_id} has no running init") from None
        try:
            sock = await connect_in_netns(pid, cgroup_path(sandbox_id), port)
        except TimeoutError:
            raise Unavailable(f"port {port} in sandbox {sandbox_id} did not accept a connection within "
                              f"{CONNECT_TIMEOUT_S:g} s", field="port",
                              fix="the server in the sandbox may be overloaded (full accept backlog); retry") from None
        try:
            return await asyncio.open_connection(sock=sock)
        except BaseException:
            sock.close()
            raise

    async def recover(self, live_ids: set[str]) -> None:
        """After an edge restart: free what dead sandboxes left, re-attach live ones' networks,
        thaw what a park (or pack_diff) the edge did not finish left frozen."""
        live: dict[str, int] = {}
        for sid in live_ids:
            try:
                live[sid] = self._pid(sid)
            except (OSError, ValueError):
                pass
            if self.cpusets is not None:     # where each one runs counts again for new picks
                try:
                    spec = await asyncio.to_thread(hibernate.load_spec, self.sandbox_dir(sid) / "run")
                    self.cpusets.adopt(sid, spec.cpus, spec.cpu_cores)
                except (OSError, ValueError, TypeError):
                    pass
            try:
                await asyncio.to_thread(self.parking.settle, cgroup_path(sid), self.sandbox_dir(sid) / "run")
            except OSError as e:
                log.warning("could not settle a sandbox's park state", extra={"sandbox": sid, "error": str(e)})
        await self.net.recover(live)
        try:
            await asyncio.to_thread(self.snaps.sweep)
        except OSError as e:
            log.warning("could not sweep container snapshots", extra={"error": str(e)})
        if self._view_restarted and live:   # the daemon died while no edge watched it
            await self._rebind_views()
        self._view_restarted = False
        self._watch_view()

    # -- lxcfs views (lxcfs.py, viewmounts.py) -------------------------------------------
    def _watch_view(self, restarted: bool = False) -> None:
        """A pidfd on the lxcfs daemon, on the event loop: its death is repaired at once (one
        repair at a time: `restarted` is the repair itself, done)."""
        if self.lxcfs is None or self._view_pidfd is not None or self.view is None or \
                (self._view_tasks and not restarted):
            return
        pid = self.lxcfs.pid()
        try:
            fd = os.pidfd_open(pid) if pid is not None else None
        except OSError:
            fd = None
        if fd is None:
            self._view_died(None)
            return
        self._view_pidfd = fd
        asyncio.get_running_loop().add_reader(fd, self._view_died, fd)

    def _view_died(self, fd: int | None) -> None:
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
            self._view_pidfd = None
        task = asyncio.get_running_loop().create_task(self._restart_view())
        self._view_tasks.add(task)
        task.add_done_callback(self._view_tasks.discard)

    async def _restart_view(self) -> None:
        """A new daemon and fresh binds in every running sandbox; with no daemon, the dead
        binds detached (the host's figures rather than ENOTCONN)."""
        assert self.lxcfs is not None
        log.warning("lxcfs died; starting it again and repairing the sandboxes' /proc views")
        since = time.monotonic() - self._view_started_at
        if since < VIEW_RESTART_MIN_S:          # one that dies at once is not restarted in a loop
            await asyncio.sleep(VIEW_RESTART_MIN_S - since)
        self._view_started_at = time.monotonic()
        self._view_gen += 1
        try:
            await asyncio.to_thread(self.lxcfs.ensure)
            self.view = self.lxcfs.mountpoint
        except (OSError, subprocess.SubprocessError) as e:
            log.error("lxcfs did not start again; sandboxes now read the host's /proc/meminfo: %s", e)
            self.view = None
        await self._rebind_views()
        self._watch_view(restarted=True)

    async def release_node(self) -> None:
        """The edge closes with no live sandbox (`dsec down`, a clean stop): the home's lxcfs
        is stopped and its FUSE mount detached. It outlives edges only for the sandboxes that
        outlive them (D50); the next edge's driver starts a new one. Kept if crun or the disk
        still holds a container of this home (one the edge no longer tracked)."""
        if self.lxcfs is None:
            return
        if any(status != "leftover" for status in (await self.list_ids()).values()):
            log.warning("lxcfs kept at close: containers of this home remain", extra={"home": str(self.paths.home)})
            return
        self._unwatch_view()          # its death below is not a crash to repair
        for task in list(self._view_tasks):
            task.cancel()
        await asyncio.gather(*self._view_tasks, return_exceptions=True)
        await asyncio.to_thread(self.lxcfs.stop)
        self.view = None
        log.info("lxcfs stopped: no sandbox left in the home", extra={"mountpoint": str(self.lxcfs.mountpoint)})

    def _unwatch_view(self) -> None:
        if self._view_pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._view_pidfd)
            os.close(self._view_pidfd)
            self._view_pidfd = None

    async def _rebind_views(self, only: list[str] | None = None) -> None:
        """viewmounts.py, in a process of its own, over every sandbox whose init runs (or `only`)."""
        items = []
        dirs = [self.sandbox_dir(s) for s in only] if only is not None else \
            ([p for p in self.paths.sandboxes.iterdir() if not p.name.startswith(".")]
             if self.paths.sandboxes.exists() else [])
        for d in dirs:
            try:
                items.append(f"{int((d / 'run' / 'pid').read_text())}:{cgroup_path(d.name)}")
            except (OSError, ValueError):
                continue          # parked to disk, or not started: its next start binds afresh
        if not items:
            return
        view = ["--view", str(self.view)] if self.view is not None else []
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dsec.backends.container.viewmounts", *view, *items,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            log.warning("some sandboxes' /proc views were not repaired", extra={"stderr": err.decode(errors="replace")})

    # -- parking (suspend/resume): parking.py --------------------------------------------
    async def park(self, sandbox_id: str) -> int:
        """Freeze the sandbox and push its memory to (compressed) swap; returns bytes pushed out."""
        try:
            return await asyncio.to_thread(self.parking.park, cgroup_path(sandbox_id),
                                           self.sandbox_dir(sandbox_id) / "run")
        except FileNotFoundError as e:
            raise cgroup_gone(sandbox_id, e) from e

    async def unpark(self, sandbox_id: str) -> None:
        if hibernate.on_disk(self.sandbox_dir(sandbox_id) / "run"):
            await self._start_again(sandbox_id)
            return
        try:
            await asyncio.to_thread(self.parking.unpark, cgroup_path(sandbox_id), self.sandbox_dir(sandbox_id) / "run")
        except FileNotFoundError as e:
            raise cgroup_gone(sandbox_id, e) from e

    async def hibernate(self, sandbox_id: str) -> int | None:
        """Park a quiescent container to disk (hibernate.py): its runtime, cgroups and network
        torn down, its directory kept (upper dir, user-id range claim, spec). None: not
        quiescent (or turned off, DSEC_PARK_TO_DISK=0), nothing changed."""
        if not self.park_to_disk:
            return None
        run = self.sandbox_dir(sandbox_id) / "run"
        try:
            held = await asyncio.to_thread(self._freeze_if_quiescent, sandbox_id)
        except FileNotFoundError as e:
            raise cgroup_gone(sandbox_id, e) from e
        if held is None:
            return None
        # the marker first: an edge that dies from here on finds it parked, and the start
        # again tears down whatever of the runtime is left
        spec = replace(hibernate.load_spec(run), network=tuple(self.net.allows_of(sandbox_id)))
        await asyncio.to_thread(hibernate.save_spec, run, spec)
        await asyncio.to_thread(hibernate.mark, run, time.time(), held)
        await self._remove_runtime(sandbox_id)
        return held

    def _freeze_if_quiescent(self, sandbox_id: str) -> int | None:
        """Freeze; if nothing but the agent runs and nothing lives outside the files, stay
        frozen and return the bytes it holds; else thaw and return None. Blocking."""
        rel = cgroup_path(sandbox_id)
        run = self.sandbox_dir(sandbox_id) / "run"
        pid = self._pid(sandbox_id)
        procs = (cgroups.v2_dir(rel) if self.cgroup_v2 else cgroups.v1_dir("memory", rel)) / "cgroup.procs"
        # a command that just ended was reported by its supervisor before that process exits:
        # give it a moment rather than park in memory for it (seen 2 in 16 on a loaded box)
        deadline = time.monotonic() + SETTLE_S
        while procs.read_text().split() != [str(pid)] and time.monotonic() < deadline:
            time.sleep(0.005)
        held = self.parking.memory(rel).resident
        self.parking.freeze(rel)
        try:
            why = hibernate.why_not_quiescent(pid, procs, run)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            why = f"could not look inside: {e}"
        if why:
            self.parking.thaw(rel)
            log.info("sandbox parked in memory, not to disk", extra={"sandbox": sandbox_id, "why": why})
            return None
        return held

    async def _remove_runtime(self, sandbox_id: str) -> None:
        """Kill the sandbox's processes, remove crun's state, its cgroups and its network;
        its directory stays. Idempotent."""
        run = self.sandbox_dir(sandbox_id) / "run"
        try:
            os.kill(self._pid(sandbox_id), signal.SIGKILL)   # its pid namespace's init: all go
        except (OSError, ValueError):
            pass
        try:
            self.parking.thaw(cgroup_path(sandbox_id))       # frozen tasks die once thawed
        except OSError:
            pass
        await self._crun_delete(sandbox_id)              # whatever it says: idempotent
        await asyncio.to_thread(_remove_cgroups, sandbox_id)
        await self.net.release(sandbox_id)
        (run / "pid").unlink(missing_ok=True)
        (run / "agent.sock").unlink(missing_ok=True)

    async def _start_again(self, sandbox_id: str) -> None:
        """Start a container parked to disk over its kept directory, as it was parked: same
        layers, upper dir, id range, limits and network policy; a fresh agent."""
        d = self.sandbox_dir(sandbox_id)
        run = d / "run"
        spec = await asyncio.to_thread(hibernate.load_spec, run)
        if (run / "pid").exists():          # a park the edge did not see through
            await self._remove_runtime(sandbox_id)
        try:
            cfg = build_config(spec, self.agent_binary, cgroup_v2=self.cgroup_v2, quota_floor=self.quota_floor,
                               view=self.view, bundle=d)      # volumes: the idmapped clones again
            self.filters.annotate(cfg)
            await asyncio.to_thread((d / "config.json").write_text, json.dumps(cfg))
            await asyncio.to_thread(self._precreate_cgroups, sandbox_id)
            listener = self._listen(self.agent_socket(sandbox_id))
            try:
                pid = await self._run_crun(sandbox_id, d, spec, listener)
            finally:
                listener.close()
            await self.net.setup(sandbox_id, pid, list(spec.network))
        except BaseException:
            await asyncio.shield(self._remove_runtime(sandbox_id))   # parked to disk, as before
            raise
        (run / PARKED_MARKER).unlink(missing_ok=True)

    async def reclaim(self, sandbox_id: str) -> int:
        """Push a running sandbox's memory out without freezing it (idle reclaim; parking.py)."""
        try:
            return await asyncio.to_thread(self.parking.reclaim, cgroup_path(sandbox_id),
                                           self.sandbox_dir(sandbox_id) / "run")
        except FileNotFoundError as e:
            raise cgroup_gone(sandbox_id, e) from e

    def pss(self, sandbox_id: str) -> int | None:
        """Memory charged to the sandbox's cgroup now (its processes, page cache, kernel memory)."""
        if hibernate.on_disk(self.sandbox_dir(sandbox_id) / "run"):
            return 0
        try:
            return self.parking.memory(cgroup_path(sandbox_id)).resident
        except (OSError, ValueError):
            return None

    def usage(self, sandbox_id: str) -> RawUsage | None:
        if hibernate.on_disk(self.sandbox_dir(sandbox_id) / "run"):
            return None
        try:
            raw = usage_reader.read(cgroup_path(sandbox_id), sandbox_id, self.cgroup_v2)
        except (OSError, ValueError, KeyError):
            return None
        # the writable layer is walked (~10 us a file) at most once a DISK_WALK_EVERY_S, however
        # often the sandbox is sampled (the cgroup reads are ~70 us all told)
        now = time.monotonic()
        at, used = self._disk_seen.get(sandbox_id, (-DISK_WALK_EVERY_S, 0))
        if now - at >= DISK_WALK_EVERY_S:
            used = self.disk.usage(self.sandbox_dir(sandbox_id) / "upper")
            self._disk_seen[sandbox_id] = (now, used)
        return replace(raw, disk_bytes=used)

    def swapped(self, sandbox_id: str) -> int | None:
        if hibernate.on_disk(self.sandbox_dir(sandbox_id) / "run"):
            return 0
        try:
            return self.parking.memory(cgroup_path(sandbox_id)).swapped
        except (OSError, ValueError):
            return None

    async def pause(self, sandbox_id: str) -> None:
        """Freeze every process of the sandbox (cgroup freezer)."""
        await self._crun_checked("pause", sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        await self._crun_checked("resume", sandbox_id)

    async def _crun_checked(self, verb: str, sandbox_id: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self._crun(verb, sandbox_id), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise SandboxFailed(f"crun {verb} {sandbox_id} failed: {err.decode(errors='replace').strip()}")

    # -- exit detection ------------------------------------------------------------------
    def watch_exit(self, sandbox_id: str, on_exit: Callable[[], None]) -> bool:
        """A pidfd on the sandbox's init (the agent, crun's pid file), readable on the event
        loop the moment it exits: kill -9 from the host, the OOM killer, a crash."""
        self.unwatch_exit(sandbox_id)
        loop = asyncio.get_running_loop()
        try:
            pid = self._pid(sandbox_id)
            pidfd = os.pidfd_open(pid)
        except (OSError, ValueError):
            loop.call_soon(on_exit)        # gone already: let the edge look at it now
            return True
        try:
            start = procstat.fields(pid)[19]
            # a dead sandbox's pid file may name a pid reused since: it must be in the sandbox's cgroup
            ours = any(line.endswith(":" + cgroup_path(sandbox_id))
                       for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
        except (OSError, IndexError):
            ours = False
        if not ours:
            os.close(pidfd)
            loop.call_soon(on_exit)
            return True
        w = _ExitWatch(pid, pidfd, start, on_exit)
        self._watches[sandbox_id] = w
        loop.add_reader(pidfd, self._exited, sandbox_id, w)
        return True

    def unwatch_exit(self, sandbox_id: str) -> None:
        w = self._watches.pop(sandbox_id, None)
        if w is None:
            return
        if not w.fired:
            try:
                asyncio.get_running_loop().remove_reader(w.pidfd)
            except RuntimeError:           # no loop running (interpreter shutdown)
                pass
        os.close(w.pidfd)

    def _exited(self, sandbox_id: str, w: _ExitWatch) -> None:
        if self._watches.get(sandbox_id) is not w or w.fired:
            return
        asyncio.get_running_loop().remove_reader(w.pidfd)
        w.fired = True
        w.status = self._exit_status(w)
        w.on_exit()

    @staticmethod
    def _exit_status(w: _ExitWatch) -> int | None:
        """The init's wait status: from /proc while it is a zombie (stat field 52; the host's
        init reaps it, maybe late), from the pidfd once reaped (Linux 6.15+); None if unknown
        (or still running)."""
        try:
            f = procstat.fields(w.pid)
            if f[19] == w.start:
                return int(f[49]) if f[0] in ("Z", "X") else None
        except (OSError, IndexError, ValueError):
            pass
        info = bytearray(64)
        struct.pack_into("<Q", info, 0, PIDFD_INFO_EXIT)
        try:
            fcntl.ioctl(w.pidfd, PIDFD_GET_INFO, info)
        except OSError:
            return None
        return struct.unpack_from("<i", info, 60)[0] if struct.unpack_from("<Q", info)[0] & PIDFD_INFO_EXIT else None

    def end_reason(self, sandbox_id: str, cause: BaseException | None) -> str:
        """How the sandbox's init (its agent) ended, and whether the OOM killer did it. Read
        before destroy(): the cgroup's OOM kill count goes with `crun delete`."""
        w = self._watches.get(sandbox_id)
        status = w.status if w is not None and w.status is not None else (self._exit_status(w) if w else None)
        kills = cgroups.oom_kills(cgroup_path(sandbox_id))
        signalled = status is not None and os.WIFSIGNALED(status)
        if kills and (status is None or (signalled and os.WTERMSIG(status) == signal.SIGKILL)):
            # SIGKILL cannot reach a pid namespace's init from inside it: the host or the OOM killer
            if cgroups.oom_from_above(cgroup_path(sandbox_id)):
                return (f"host memory pressure: the kernel's OOM killer killed the sandbox's agent, its init, "
                        f"while the sandbox was below its own memory_mb={self._memory_mb(sandbox_id)} (the host "
                        f"or the node's sandboxes cgroup ran out; {kills} OOM kill(s) in the sandbox); "
                        "not the sandbox's doing: run it again")
            return (f"out of memory (memory_mb={self._memory_mb(sandbox_id)}): the kernel's OOM killer killed the "
                    f"sandbox's agent, its init, which ends the sandbox ({kills} OOM kill(s) in the sandbox); "
                    "create it with a larger memory_mb")
        if signalled:
            sig = os.WTERMSIG(status)   # type: ignore[arg-type]
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return f"the sandbox's init (its agent) was killed by {name} (signal {sig}) from outside the sandbox"
        if status is not None and os.WIFEXITED(status):
            return f"the sandbox's init (its agent) exited with status {os.WEXITSTATUS(status)}"
        return super().end_reason(sandbox_id, cause)

    def end_code(self, sandbox_id: str) -> str:
        """oom_killed where the cgroup counted an OOM kill and the init died of SIGKILL (or
        its status is unknown), as end_reason() words it; host_pressure where that OOM came from
        above the sandbox (cgroups.oom_from_above); else the runtime died (agent_died)."""
        w = self._watches.get(sandbox_id)
        status = w.status if w is not None and w.status is not None else (self._exit_status(w) if w else None)
        signalled = status is not None and os.WIFSIGNALED(status)
        if cgroups.oom_kills(cgroup_path(sandbox_id)) and (
                status is None or (signalled and os.WTERMSIG(status) == signal.SIGKILL)):
            # its own limit -> oom_killed; the host's or an ancestor cgroup's -> host_pressure
            return "host_pressure" if cgroups.oom_from_above(cgroup_path(sandbox_id)) else "oom_killed"
        return "agent_died"

    def _memory_mb(self, sandbox_id: str) -> int | str:
        try:
            cfg = json.loads((self.sandbox_dir(sandbox_id) / "config.json").read_text())
            return int(cfg["linux"]["resources"]["memory"]["limit"]) >> 20
        except (OSError, ValueError, KeyError, TypeError):
            return "?"

    async def is_running(self, sandbox_id: str) -> bool:
        w = self._watches.get(sandbox_id)
        if w is not None and w.fired:      # its init exited (watch_exit): no need to ask crun
            return False
        proc = await asyncio.create_subprocess_exec(
            *self._crun("state", sandbox_id), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            return False
        try:
            return json.loads(out).get("status") in ("running", "paused")   # paused: frozen, alive
        except ValueError:
            return False

    async def list_ids(self) -> dict[str, str]:
        """Every container crun knows in this instance, with its status (RUNNING, PARKED,
        'stopped' ...), and sandbox dirs on disk that crun does not know ('leftover'). Parked:
        a finished park's marker (frozen without it: a park or pack_diff the edge did not finish,
        reported RUNNING and thawed by recover())."""
        proc = await asyncio.create_subprocess_exec(
            *self._crun("list", "--format", "json"), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        out, _ = await proc.communicate()
        try:
            known = {c["id"]: c.get("status", "") for c in json.loads(out or b"[]")}
        except (ValueError, KeyError, TypeError):
            known = {}
        for sid, status in known.items():
            if status in ("running", "paused"):
                known[sid] = PARKED if (self.sandbox_dir(sid) / "run" / PARKED_MARKER).exists() else RUNNING
        dirs = {p.name for p in self.paths.sandboxes.iterdir() if not p.name.startswith(".")} \
            if self.paths.sandboxes.exists() else set()   # dot names: .snap (snapshots.py), volumes.py's
        left = {d: PARKED if hibernate.on_disk(self.sandbox_dir(d) / "run") else "leftover"
                for d in dirs if d not in known}
        return {**left, **known}


def _kill_inflight_create(bundle: Path, wait_s: float = 5.0) -> None:
    """A create that never finished (the edge died during `crun run`: no pid file) may still
    have its nsexec/crun processes running, outliving the edge; tearing down under them leaves
    cgroups and mounts behind. They are found by the bundle path in their argv and killed."""
    needle = str(bundle).encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        if pids:
            time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return procstat.fields(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _remove_cgroups(sandbox_id: str, wait_s: float = 10.0) -> None:
    """rmdir the sandbox's cgroup directories in every hierarchy; processes still in one (a
    half-started init) are killed first. Retried until wait_s: a killed process leaves its
    cgroups a moment after it is gone, and a killed pid namespace's init waits for all of its
    namespace to exit first (more than a second on a loaded node: 1 s left cgroups behind)."""
    left: list[Path] = []
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for cg in cgroups.leftover_dirs(cgroup_path(sandbox_id)):
            try:
                cg.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                left.append(cg)
                try:
                    for pid in (cg / "cgroup.procs").read_text().split():
                        os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
        if not left:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    log.warning("cgroups left behind", extra={"sandbox": sandbox_id, "paths": [str(c) for c in left]})


def _make_dsec_dir(path: Path) -> None:
    """The read-only /.dsec of every sandbox: a directory with one empty file, `agent`, the
    mount point of the agent binary (a read-only mount cannot get a new mount point)."""
    path.mkdir(mode=0o755, exist_ok=True)
    (path / "agent").touch(exist_ok=True)
    os.chmod(path, 0o755)             # any umask: root inside (another uid) must traverse it
    os.chmod(path / "agent", 0o444)
    extra = sorted(p.name for p in path.iterdir() if p.name != "agent")
    if extra:
        raise Unavailable(f"{path} must hold only the file 'agent': it is bound at /.dsec in every sandbox",
                          fix=f"remove {', '.join(extra)} from {path} (dsec puts nothing else there)")


def _make_mask_dir(path: Path) -> None:
    """The empty, read-only directory bound over masked directories in every sandbox."""
    path.mkdir(mode=0o555, exist_ok=True)
    os.chmod(path, 0o555)   # any umask
    if any(path.iterdir()):
        raise Unavailable(f"{path} must be empty: it is bound over masked directories in every sandbox",
                          fix=f"remove what is in {path} (dsec does not put anything there)")
