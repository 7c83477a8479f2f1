"""CPU QoS classes of container sandboxes (ContainerArgs.cpu_class), docs/decisions.md D27.

latency (default): the sandbox's cgroup weight is proportional to its cpu_cores (cpu.shares
1024 per core; crun maps it to cpu.weight on cgroup v2) under its CFS quota. Where the kernel
has core scheduling (CONFIG_SCHED_CORE, SMT siblings present) its agent gets a core-scheduling
cookie of its own, inherited by everything it starts: no other sandbox's task runs on the SMT
sibling of one of its tasks at the same time.

batch (best effort): runs only on CPU that latency sandboxes leave idle. Both layers of the CFS
hierarchy are told: the cgroup has the minimum weight (v1 cpu.shares 2; v2 weight 1 and
cpu.idle 1), and every task has the SCHED_IDLE policy, set from the host on the agent (the
container's PID 1) right after `crun run`: everything the agent starts later inherits it
(fork/posix_spawn keep the policy; the agent sets no SCHED_RESET_ON_FORK). A waking latency
task preempts a running SCHED_IDLE task at once. The sandbox cannot leave SCHED_IDLE: that
needs CAP_SYS_NICE in the initial user namespace (a sandbox never has it) or an RLIMIT_NICE of
20 or more, which the spec pins to 0 (with RLIMIT_RTPRIO, for the real-time policies).

The policy lives with the processes: an edge restart, a freeze/thaw (parking) or pack_diff
changes nothing, and nothing needs redoing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

from dsec.backends.container import cgroups
from dsec.types import SandboxFailed

log = logging.getLogger("dsec.backends.container")

LATENCY, BATCH = "latency", "batch"
SHARES_PER_CORE = 1024
BATCH_SHARES = 2        # the kernel's minimum (cgroup v1 cpu.shares)

# prctl(PR_SCHED_CORE, ...) (linux/prctl.h): core-scheduling cookies (Linux 5.14+, CONFIG_SCHED_CORE)
PR_SCHED_CORE = 62
PR_SCHED_CORE_GET = 0
PR_SCHED_CORE_CREATE = 1
PIDTYPE_PID, PIDTYPE_TGID = 0, 1


CPU_PERIOD_US = 100_000
# The CFS quota never goes below this many cores (10 ms per 100 ms period by default): under it
# one ordinary command (fork + exec + a few ms of work) overruns the period's budget and waits
# for the next period; at cpu_cores=0.005 (0.5 ms) `exec true` took p50 290 ms vs 15 ms at 0.05
# (D35). cpu.shares stays proportional to cpu_cores, so under contention the request is what
# counts; the floor only lets an idle sandbox's rare command finish in one period.
DEFAULT_QUOTA_FLOOR_CORES = 0.1   # DSEC_CPU_QUOTA_FLOOR_CORES


def cpu_quota_us(cpu_cores: float, floor_cores: float = DEFAULT_QUOTA_FLOOR_CORES) -> int:
    """cpu.cfs_quota_us for a sandbox asking cpu_cores (OCI linux.resources.cpu.quota), with
    the node's floor; 1 ms is the kernel's minimum."""
    return max(1000, int(max(cpu_cores, floor_cores) * CPU_PERIOD_US))


def cpu_shares(cpu_class: str, cpu_cores: float) -> int:
    """cpu.shares of a sandbox's cgroup (OCI linux.resources.cpu.shares)."""
    if cpu_class == BATCH:
        return BATCH_SHARES
    return max(BATCH_SHARES, int(SHARES_PER_CORE * cpu_cores))


def rlimits(cpu_class: str) -> list[dict]:
    """OCI process rlimits a class adds: a batch sandbox may not raise its priority back."""
    if cpu_class != BATCH:
        return []
    return [{"type": "RLIMIT_NICE", "hard": 0, "soft": 0}, {"type": "RLIMIT_RTPRIO", "hard": 0, "soft": 0}]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def core_sched_supported() -> bool:
    """Whether this kernel does core scheduling: prctl(PR_SCHED_CORE) fails with EINVAL
    without CONFIG_SCHED_CORE and with ENODEV on a machine without SMT siblings."""
    cookie = ctypes.c_ulong(0)
    if _libc().prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, PIDTYPE_PID, ctypes.byref(cookie)) == 0:
        return True
    log.debug("no core scheduling here", extra={"error": os.strerror(ctypes.get_errno())})
    return False


def _tasks(rel: str, v2: bool) -> list[int]:
    """Every thread in a sandbox's cgroup (the cpu controller's view)."""
    f = cgroups.v2_dir(rel) / "cgroup.threads" if v2 else cgroups.v1_dir("cpu", rel) / "tasks"
    try:
        return [int(t) for t in f.read_text().split()]
    except (OSError, ValueError):
        return []


def apply(cpu_class: str, agent_pid: int, rel: str, *, v2: bool) -> None:
    """Give a just-started sandbox its class (call right after `crun run`, before any command).
    A batch sandbox that cannot be made SCHED_IDLE is not started (SandboxFailed)."""
    if cpu_class == BATCH:
        if v2:
            try:
                (cgroups.v2_dir(rel) / "cpu.idle").write_text("1")    # Linux 5.15+
            except OSError as e:
                log.warning("could not set cpu.idle on a batch sandbox (SCHED_IDLE still applies)",
                            extra={"cgroup": rel, "error": str(e)})
        try:
            os.sched_setscheduler(agent_pid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as e:
            raise SandboxFailed(f"could not make the batch sandbox's agent SCHED_IDLE: {e}",
                                fix="create it with cpu_class='latency', or see the edge log") from e
        for tid in _tasks(rel, v2):      # anything else already there (nothing, normally)
            if tid != agent_pid:
                try:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                except ProcessLookupError:
                    pass          # gone since the listing
                except OSError as e:
                    raise SandboxFailed(f"could not make a batch sandbox's task SCHED_IDLE: {e}") from e
    # latency: its own core-scheduling cookie for the agent's thread group, inherited by all it
    # starts (where the kernel has it; untested on the dev machines, which do not)
    elif core_sched_supported() and _libc().prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, agent_pid, PIDTYPE_TGID, 0):
        log.warning("could not give a latency sandbox a core-scheduling cookie",
                    extra={"cgroup": rel, "error": os.strerror(ctypes.get_errno())})


def policy(pid: int) -> str:
    """A process's scheduling policy by name (for tests and diagnostics)."""
    names = {os.SCHED_OTHER: "other", os.SCHED_BATCH: "batch", os.SCHED_IDLE: "idle",
             os.SCHED_FIFO: "fifo", os.SCHED_RR: "rr"}
    p = os.sched_getscheduler(pid)
    return names.get(p, str(p))

