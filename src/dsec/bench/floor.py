"""The floor of a cold create: crun with dsec's containment, run directly (no server, no agent).

Issue 29 item 2 compares a burst of dsec creates (create -> first output) with raw `crun run echo
hi`. Part of dsec's extra time is the containment every sandbox must keep (its own user
namespace with idmapped layers, the overlay over EROFS made by nsexec, masked and read-only
paths, seccomp, lxcfs's /proc files, cgroup limits, a network namespace); the rest is the
platform above it (API, edge, bundle preparation, the agent). This module replays what the
container driver hands crun: the config.json `spec.build_config` makes and the nsexec argv of
`driver._run_crun`, with the process replaced by `echo hi` and run in the foreground, so a burst
of these measures "crun + dsec's containment" beside raw crun and dsec in one run.

Each containment part can be switched off in the replay (`PARTS`), never in dsec: a burst per
variant says what each part costs crun. Bundles are made before the clock starts, as the raw
baseline's are; their preparation is timed apart (`prep_ms`, serial). Not in the replay: the
network policy's cgroup-BPF attach and the CPU QoS write, which the driver does after crun
returns, in its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dsec.backends.container import cgroups
from dsec.backends.container.cpusets import CpuSets
from dsec.backends.container.crun_bin import crun_binary
from dsec.backends.container.idmap import IdRanges
from dsec.backends.container.seccomp_bpf import STATE_FILE, CompiledFilters
from dsec.backends.container.spec import ContainerSpec, build_config, mask_dir
from dsec.bench.core import _pct
from dsec.config import Paths
from dsec.settings import Settings
from dsec.types import ContainerArgs

FLOOR_CGROUP_PARENT = "/dsec-bench-floor"
# what each part switches off in the replay (a variant is a set of them; "full": none)
PARTS = {
    "userns": "own user namespace and idmapped layers (nsexec -u/-l/-N)",
    "overlay": "nsexec's overlay over EROFS (crun on the read-only EROFS layer; implies no userns)",
    "seccomp": "the seccomp filter",
    "masks": "masked and read-only paths (and the empty-dir binds over masked directories)",
    "lxcfs": "lxcfs's /proc and /sys files bound in",
    "netns": "the network namespace (and its socket sysctls)",
    "limits": "cgroup limits: memory, kernel TCP, CPU quota/shares/cpuset, pids (and the cpuset made first)",
    "crun_ro": "crun from the node's read-only bind (D92): crun as installed, which copies itself first",
    "seccomp_bpf": "the seccomp filter crun compiled once, handed back (D103): crun compiles it at every start",
}
VARIANTS: dict[str, frozenset[str]] = {"full": frozenset(), **{f"no-{p}": frozenset({p}) for p in PARTS},
                                       "bare": frozenset(PARTS)}


@dataclass
class Kit:
    """What the container driver of a dsec home uses to start a sandbox, for the replay."""

    paths: Paths
    rootfs: Path                      # the image's mounted EROFS layer (single-layer images)
    conf: Settings = field(default_factory=Settings)

    def __post_init__(self) -> None:
        from dsec.agent.build import agent_binary
        from dsec.backends.container.driver import NSEXEC_SOURCE
        from dsec.backends.container.lxcfs import Lxcfs
        from dsec.native import compile_static
        self.agent = agent_binary(self.paths.bin)
        self.nsexec = compile_static(NSEXEC_SOURCE, self.paths.bin, "dsec-nsexec")   # the driver's (cached)
        if not mask_dir(self.agent).is_dir():
            raise RuntimeError(f"{self.paths.home} has no started container driver (its mask dir): start its server first")
        c = self.conf.containers
        lx = Lxcfs(self.paths.home / "lxcfs")
        self.view = lx.mountpoint if c.lxcfs and lx.healthy() else None
        self.ids = IdRanges(c.idmap_registry, c.idmap_first, c.idmap_slots) if c.userns else None
        self.cpusets = CpuSets() if c.cpuset else None
        self.cpuset_v1 = cgroups.cpuset_v1_root()
        self.cgroup_v2 = cgroups.is_unified()
        self.crun_ro = crun_binary("crun")
        self.filters = CompiledFilters(self.crun_ro)     # as the driver keeps it (seccomp_bpf.py)
        resolv = sorted((self.paths.home / "net").glob("resolv-*.conf"))
        self.resolv_conf = str(resolv[0]) if resolv else None


@dataclass
class Bundle:
    cid: str
    dir: Path
    argv: list[str]
    id_base: int | None


class Floor:
    """Bundles of one variant under `root` (a directory of the dsec home), run and removed."""

    def __init__(self, kit: Kit, root: Path):
        self.kit, self.root = kit, root
        self.state = root / "state"
        root.mkdir(mode=0o711, exist_ok=True)
        os.chmod(root, 0o711)            # crun's unprivileged init walks through to the rootfs
        self.bundles: list[Bundle] = []

    def crun(self, off: frozenset[str]) -> list[str]:
        return ["crun" if "crun_ro" in off else self.kit.crun_ro, "--root", str(self.state)]

    def prepare(self, cid: str, off: frozenset[str], process: list[str] | None = None) -> Bundle:
        """What driver._prepare_bundle and _run_crun do for a 1-core / 256 MiB sandbox of the
        image (the burst's shape), minus the parts in `off`; the process is `echo hi` or `process`."""
        k = self.kit
        d = self.root / cid
        d.mkdir(mode=0o700)
        for sub in ("upper", "work", "rootfs", "run"):
            (d / sub).mkdir(mode=0o700)
        os.chmod(d / "upper", 0o755)
        overlay = "overlay" not in off
        userns = overlay and "userns" not in off and k.ids is not None
        base = None
        if userns:
            assert k.ids is not None
            base = k.ids.allocate(d)
            (d / "run" / "userns").touch(mode=0o600)
            os.chown(d / "upper", base, base)
            os.chmod(d, 0o711)
            (d / "lower").mkdir(mode=0o700)
            (d / "lower" / "0").mkdir(mode=0o700)
        args = ContainerArgs(image="floor", cpu_cores=1, memory_mb=256)
        limits = "limits" not in off
        spec = ContainerSpec(sandbox_id=cid, lower_dirs=[k.rootfs], cpu_cores=1, memory_mb=256,
                             pids_limit=args.pids_limit, uid=1000, gid=1000, workdir="/",
                             resolv_conf=k.resolv_conf, nofile=args.nofile, id_base=base,
                             userns_path=str(d / "run" / "userns") if userns else None,
                             cpus=k.cpusets.pick(cid, 1) if k.cpusets and limits else "")
        cfg = build_config(spec, k.agent, cgroup_v2=k.cgroup_v2, quota_floor=k.conf.containers.cpu_quota_floor_cores,
                           view=None if "lxcfs" in off else k.view, bundle=d)
        cfg["process"]["args"] = process or ["echo", "hi"]
        lx = cfg["linux"]
        lx["cgroupsPath"] = f"{FLOOR_CGROUP_PARENT}/{cid}"
        if "seccomp" in off:
            lx.pop("seccomp", None)
        elif "seccomp_bpf" not in off:
            k.filters.annotate(cfg)
        if "masks" in off:
            lx["maskedPaths"], lx["readonlyPaths"] = [], []
            cfg["mounts"] = [m for m in cfg["mounts"] if m.get("source") != str(mask_dir(k.agent))]
        if "netns" in off:
            lx["namespaces"] = [n for n in lx["namespaces"] if n["type"] != "network"]
            lx.pop("sysctl", None)      # without its own netns crun would write the host's
        if not limits:
            lx["resources"] = {"devices": lx["resources"]["devices"]}
        elif k.cpuset_v1 is not None:
            cgroups.precreate_cpuset_v1(k.cpuset_v1, lx["cgroupsPath"])
        crun = [*self.crun(off), "run", "--bundle", str(d), cid]
        if overlay:
            lower, idm = str(k.rootfs), []
            if userns:
                lower = str(d / "lower" / "0")
                idm = ["-u", str(base), "-N", str(d / "run" / "userns"), "-l", f"{k.rootfs}:{lower}"]
            opts = f"lowerdir={lower},upperdir={d / 'upper'},workdir={d / 'work'}"
            argv = [str(k.nsexec), "-o", opts, "-t", str(d / "rootfs"), *idm, "--", *crun]
        else:
            cfg["root"] = {"path": str(k.rootfs), "readonly": True}
            # crun cannot make mountpoints on a read-only root: keep the mounts the image has a place for
            cfg["mounts"] = [m for m in cfg["mounts"] if (k.rootfs / m["destination"].lstrip("/")).exists()]
            argv = crun
        (d / "config.json").write_text(json.dumps(cfg))
        b = Bundle(cid, d, argv, base)
        self.bundles.append(b)
        return b

    async def learn_filter(self) -> None:
        """What the driver's first start does: one container of the full replay, whose compiled
        seccomp filter is kept (outside any clock)."""
        b = await asyncio.to_thread(self.prepare, f"learn{os.getpid()}", frozenset(), ["sleep", "3"])
        p = await asyncio.create_subprocess_exec(*b.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL)
        state = self.state / b.cid
        for _ in range(100):
            if (state / STATE_FILE).exists() or p.returncode is not None:
                break
            await asyncio.sleep(0.05)
        self.kit.filters.learn(json.loads((b.dir / "config.json").read_text()), state)
        d = await asyncio.create_subprocess_exec(*self.crun(frozenset()), "delete", "-f", b.cid,
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await d.wait()
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        await p.wait()

    def cleanup(self) -> list[str]:
        """Remove every bundle, its id range, cgroups and crun state; what was left (cgroup dirs)."""
        k = self.kit
        if self.state.is_dir():
            left = subprocess.run(self.crun(frozenset()) + ["list", "-q"], check=False, capture_output=True,
                                  text=True).stdout.split()
            for cid in left:
                subprocess.run(self.crun(frozenset()) + ["delete", "-f", cid], check=False, capture_output=True)
        leftovers: list[str] = []
        for b in self.bundles:
            if b.id_base is not None and k.ids is not None:
                k.ids.release(b.id_base, b.dir)
            if k.cpusets:
                k.cpusets.release(b.cid)
            rel = f"{FLOOR_CGROUP_PARENT}/{b.cid}"
            for p in cgroups.leftover_dirs(rel):
                with contextlib.suppress(OSError):
                    p.rmdir()
            leftovers += [str(p) for p in cgroups.leftover_dirs(rel)]
            shutil.rmtree(b.dir, ignore_errors=True)
        self.bundles.clear()
        return leftovers

    def close(self) -> None:
        self.cleanup()
        roots = [cgroups.CGROUP_ROOT] if cgroups.is_unified() else \
            [p for p in cgroups.CGROUP_ROOT.iterdir() if p.is_dir()]
        for r in roots:
            with contextlib.suppress(OSError):
                (r / FLOOR_CGROUP_PARENT.lstrip("/")).rmdir()
        shutil.rmtree(self.root, ignore_errors=True)


def _cpu_busy() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)       # all but idle and iowait; all


async def quiet(min_s: float = 1.0, max_s: float = 15.0, busy: float = 0.2) -> float:
    """Wait until the host's CPUs are at most `busy` used over half a second (at least min_s, at
    most max_s): a burst's aftermath (netns and cgroup teardown in kernel workers) must not land
    in the next burst measured. Returns the seconds waited."""
    t0 = time.perf_counter()
    await asyncio.sleep(min_s)
    while time.perf_counter() - t0 < max_s:
        b0, a0 = _cpu_busy()
        await asyncio.sleep(0.5)
        b1, a1 = _cpu_busy()
        if a1 > a0 and (b1 - b0) / (a1 - a0) <= busy:
            break
    return time.perf_counter() - t0


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def run_burst(argvs: list[list[str]], done: Callable[[], None] = lambda: None) -> dict:
    """All commands at once; each one's spawn -> first line of output, the wall time, and the
    CPU of the children (rusage of the waited processes: nsexec/crun and what they waited for)."""
    ttfo: list[float] = []
    errs: list[str] = []
    last = [0.0]

    async def one(argv: list[str]) -> None:
        t0 = time.perf_counter()
        p = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE)
        assert p.stdout is not None
        line = await p.stdout.readline()
        if line:
            last[0] = time.perf_counter()
            ttfo.append((last[0] - t0) * 1000)
        _, err = await p.communicate()
        if p.returncode != 0 or not line:
            errs.append(f"{argv[-1]}: exit {p.returncode} {err.decode(errors='replace')[-300:]!r}")
        done()
    cpu0 = _children_cpu_s()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(a) for a in argvs))
    wall = time.perf_counter() - t0
    cpu = _children_cpu_s() - cpu0
    return {"n": len(ttfo), "p50_ms": _pct(ttfo, 50) if ttfo else None, "p99_ms": _pct(ttfo, 99) if ttfo else None,
            "max_ms": max(ttfo) if ttfo else None, "wall_s": wall,
            "last_output_s": last[0] - t0 if ttfo else None, "cpu_ms_per_create": 1000 * cpu / max(1, len(argvs)),
            "failed": len(errs), "errors": errs[:5], "ttfo_ms": ttfo}


def hold_args(hold_s: float) -> list[str]:
    """`echo hi`, then the container lives on for hold_s: as a dsec sandbox's does, its teardown
    then falls after the burst's outputs instead of among them."""
    return ["sh", "-c", f"echo hi; exec sleep {hold_s:g}"]


async def floor_burst(kit: Kit, n: int, variant: str = "full", tag: str = "f",
                      done: Callable[[], None] = lambda: None, hold_s: float = 0) -> dict:
    """A burst of n `echo hi` containers started as the driver starts a sandbox (minus the
    variant's parts), bundles made before the clock; everything removed after. hold_s > 0:
    each container lives on that long after its output (hold_args)."""
    off = VARIANTS[variant]
    process = hold_args(hold_s) if hold_s > 0 else None
    fl = Floor(kit, kit.paths.home / f"floor-{tag}-{os.getpid()}")
    try:
        if "seccomp" not in off and "seccomp_bpf" not in off and not kit.filters.known:
            await fl.learn_filter()
        t0 = time.perf_counter()
        bundles = await asyncio.to_thread(lambda: [fl.prepare(f"{tag}{os.getpid()}-{i}", off, process) for i in range(n)])
        prep_ms = (time.perf_counter() - t0) * 1000 / n
        res = await run_burst([b.argv for b in bundles], done)
    finally:
        left = await asyncio.to_thread(fl.cleanup)
        await asyncio.to_thread(fl.close)
    return {**res, "variant": variant, "off": sorted(off), "hold_s": hold_s, "prep_ms": prep_ms, "cgroups_left": left}
