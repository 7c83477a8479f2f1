"""Parking a quiescent container to disk: nothing of it left in memory, started again on resume.

A parked container that keeps its processes (parking.py) still costs the host ~1.1 MiB: the
kernel objects of its memory cgroup, network namespace, mounts and tasks stay, whatever is
pushed to swap (docs/decisions.md D35, D44). A container in which nothing but the agent runs
holds no state outside its files, so parking it can tear it down to its writable layer on disk
(`crun delete`, cgroups, network) and resume can start it again over the same layers, upper
dir, limits, network policy and user-id range: the host keeps nothing but the directory.

It is quiescent, checked while frozen (so nothing can start meanwhile), when
- its cgroup holds one process, the agent (no command, session or background process);
- /dev holds what it held when the container started (a file written to the /dev tmpfs
  would be lost), /dev/shm and /dev/mqueue are empty;
- its IPC namespace holds no System V shared memory, semaphore or message queue;
and the edge has checked that the agent keeps no exec output nobody collected. Anything else
(a capability to mount or to change the network namespace) is not granted to sandboxes
(security/profile.py), so nothing else can hold state without a process.

Files in the sandbox's run dir: `spec.json` (the ContainerSpec to start it again, limits as
claimed), `dev.json` (/dev at start), and the `parked` marker with `"to_disk": true`.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from dataclasses import asdict
from pathlib import Path

from dsec.backends.container.parking import PARKED_MARKER
from dsec.backends.container.spec import ContainerSpec
from dsec.security.netpolicy import Allow

SPEC_FILE = "spec.json"
DEV_FILE = "dev.json"


# -- the spec to start it again ----------------------------------------------------------
def save_spec(run_dir: Path, spec: ContainerSpec) -> None:
    d = asdict(spec)
    d["lower_dirs"] = [str(p) for p in spec.lower_dirs]
    d["network"] = [a.to_json() for a in spec.network]
    tmp = run_dir / (SPEC_FILE + ".tmp")
    tmp.write_text(json.dumps(d))
    os.replace(tmp, run_dir / SPEC_FILE)


def load_spec(run_dir: Path) -> ContainerSpec:
    d = json.loads((run_dir / SPEC_FILE).read_text())
    d["lower_dirs"] = [Path(p) for p in d["lower_dirs"]]
    d["network"] = tuple(Allow.from_json(a) for a in d["network"])
    d["volumes"] = tuple(tuple(v) for v in d.get("volumes", ()))
    return ContainerSpec(**d)


# -- the marker ---------------------------------------------------------------------------
def on_disk(run_dir: Path) -> bool:
    """Whether the sandbox is parked to disk (its runtime torn down)."""
    try:
        return bool(json.loads((run_dir / PARKED_MARKER).read_text()).get("to_disk"))
    except (OSError, ValueError, AttributeError):
        return False


def mark(run_dir: Path, at: float, held: int) -> None:
    tmp = run_dir / (PARKED_MARKER + ".tmp")
    tmp.write_text(json.dumps({"at": at, "to_disk": True, "pushed_out": held}))
    os.replace(tmp, run_dir / PARKED_MARKER)


# -- quiescence ----------------------------------------------------------------------------
def dev_listing(pid: int) -> dict[str, list[object]]:
    """/dev of the container whose init is `pid`, as (kind, symlink target) per name, with
    what its shm and mqueue directories hold."""
    root = Path(f"/proc/{pid}/root/dev")
    out: dict[str, list[object]] = {}
    for name in sorted(os.listdir(root)):
        st = os.lstat(root / name)
        kind = stat.S_IFMT(st.st_mode)
        out[name] = [kind, os.readlink(root / name) if stat.S_ISLNK(st.st_mode) else None,
                     st.st_rdev if stat.S_ISCHR(st.st_mode) else None]
    return out


def record_dev(pid: int, run_dir: Path) -> None:
    (run_dir / DEV_FILE).write_text(json.dumps(dev_listing(pid)))


def why_not_quiescent(pid: int, procs_file: Path, run_dir: Path) -> str | None:
    """None if the (frozen) container can be parked to disk, else why not."""
    procs = procs_file.read_text().split()
    if procs != [str(pid)]:
        return f"{len(procs) - 1} processes besides the agent"
    try:
        start = json.loads((run_dir / DEV_FILE).read_text())
    except (OSError, ValueError):
        return "no record of its /dev at start"
    now = json.loads(json.dumps(dev_listing(pid)))     # lists, as read back from the record
    if now != start:
        return "/dev changed since it started"
    for sub in ("shm", "mqueue"):
        if os.listdir(f"/proc/{pid}/root/dev/{sub}"):
            return f"/dev/{sub} is not empty"
    r = subprocess.run(["nsenter", f"--ipc=/proc/{pid}/ns/ipc", "--", "cat", "/proc/sysvipc/shm",
                        "/proc/sysvipc/sem", "/proc/sysvipc/msg"], capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        return f"could not read its System V IPC objects: {r.stderr.strip()}"
    if len(r.stdout.splitlines()) > 3:         # a header line per file, nothing else
        return "System V IPC objects exist"
    return None
