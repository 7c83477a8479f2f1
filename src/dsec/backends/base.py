r"""The backend interface: what the edge needs of a runtime, and nothing more.

The edge owns admission, records, TTL, the agent channel and every error the caller sees; a
backend turns validated arguments into a running sandbox whose agent answers on
`agent_socket(id)`, and frees everything again. Every backend implements `Backend` (the core).
Verbs only some backends have are small capability interfaces; the edge checks them in one
place (`Edge._capability`), so a sandbox whose backend lacks one gets "backend X cannot Y"
with the backend's own advice, never a per-verb branch on backend names.

    SDK -> apiserver -> Edge -> Backend.prepare/create/wait_agent -> agent (in the sandbox)
                             \-> capabilities: Snapshots, Parking, Reclaim, LayerDiff, Egress,
                                 Console, MemoryUsage, UsageStats, LivenessWatched

The composition root (`dsec.embedded`) is the only place that names concrete backends.
"""

from __future__ import annotations

import asyncio

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from dsec.types import ImageInfo, NetworkPolicy, NetworkRuleSet, SandboxArgs

if TYPE_CHECKING:
    from dsec.agent.client import AgentClient
    from dsec.security.netpolicy import Allow

# What `list_ids` reports per sandbox the runtime knows (other values: dead, left over).
RUNNING = "running"
PARKED = "parked"


class ImageStacks(Protocol):
    """What a backend may ask of the node's images while it prepares or creates a sandbox
    (implemented by dsec.images.stacks.Stacks: cached name lookups, shared layer mounts)."""

    async def resolve(self, name: str, field: str = "image") -> ImageInfo: ...
    async def stack(self, args: Any) -> list[ImageInfo]: ...
    async def mounted_lowers(self, stack: list[ImageInfo]) -> list[Path]: ...
    def layer_files(self, stack: list[ImageInfo]) -> list[tuple[str, Path]]: ...


@dataclass
class Prepared:
    """A sandbox the backend has checked and resolved, with nothing created on the host yet.

    `args` may differ from what the caller sent (a chosen accelerator, a snapshot's sizes):
    it is what the record keeps. `plan` is the backend's own, opaque to the edge."""

    args: SandboxArgs
    image_digest: str | None
    uid: int
    gid: int
    plan: Any = None
    allows: list["Allow"] = field(default_factory=list)
    # the sandbox's volumes, resolved by the edge (dsec.volumes): (host dir, path inside, read-only)
    volumes: list[tuple[str, str, bool]] = field(default_factory=list)


class Backend(ABC):
    """The core every backend has."""

    kinds: ClassVar[tuple[str, ...]]          # the `backend` values it serves
    # advice when a verb this backend lacks is asked for: verb -> what to do instead
    instead: ClassVar[Mapping[str, str]] = {}
    disk_enforced: bool = True                # False: the edge polls disk_usage against disk_mb
    # True: create() always starts a new agent process, which holds no chans yet (the edge skips
    # the LIST_EXECS round trip at create); False: it may restore an agent (a VM clone's)
    fresh_agent_at_create: ClassVar[bool] = False

    @abstractmethod
    async def prepare(self, args: SandboxArgs, images: ImageStacks) -> Prepared:
        """Check and resolve everything the sandbox needs; raise a DsecError naming the field.
        Creates nothing on the host (the edge writes its record after this)."""

    @abstractmethod
    async def create(self, sandbox_id: str, prepared: Prepared, images: ImageStacks) -> None:
        """Start the sandbox; on failure raise and leave nothing behind."""

    async def wait_agent(self, sandbox_id: str) -> "AgentClient":
        """The first connection to a just-started (or resumed) sandbox's agent."""
        from dsec.agent.client import AgentClient
        return await AgentClient.connect(self.agent_socket(sandbox_id))

    async def ready(self, sandbox_id: str, agent: "AgentClient") -> None:
        """Called once the agent answers after a start or resume (VM clones reseed here)."""

    @abstractmethod
    async def destroy(self, sandbox_id: str) -> None:
        """Kill and free everything of the sandbox. Idempotent: absent parts are fine."""

    @abstractmethod
    async def is_running(self, sandbox_id: str) -> bool: ...

    @abstractmethod
    async def list_ids(self) -> dict[str, str]:
        """Sandboxes the runtime or its disk holds, with RUNNING, PARKED or another word
        (finds orphans after a crash: anything here without a live record is destroyed)."""

    @abstractmethod
    def agent_socket(self, sandbox_id: str) -> Path: ...

    def log_tail(self, sandbox_id: str) -> str:
        """The end of what the sandbox's init or console wrote, for error messages ("" if none)."""
        return ""

    def end_reason(self, sandbox_id: str, cause: BaseException | None) -> str:
        """Why a sandbox that stopped answering is gone, from what it left behind."""
        return f"sandbox process exited ({cause.__class__.__name__ if cause else 'no longer running'})"

    def end_code(self, sandbox_id: str) -> str:
        """end_reason() as one word of the vocabulary (types/events.py), read at the same time
        (before destroy()): by default the runtime died under it, an infrastructure failure."""
        return "agent_died"

    def watch_exit(self, sandbox_id: str, on_exit: Callable[[], None]) -> bool:
        """Call `on_exit` (once, on the event loop) when the running sandbox's runtime exits on
        its own, so the edge notices a death between requests and records end_reason() at once.
        False: this backend cannot watch (the edge notices at the next request or, for
        LivenessWatched backends, at its next check). Watching again replaces the watch."""
        return False

    def unwatch_exit(self, sandbox_id: str) -> None:
        """Stop watching (the edge lets go of the sandbox; destroy() stops it too)."""

    def disk_usage(self, sandbox_id: str) -> int:
        """Bytes in the writable layer (polled only where disk_enforced is False)."""
        return 0

    async def recover(self, live_ids: set[str]) -> None:
        """After an edge restart, once orphans are gone: re-attach what the live ones need."""

    def purge(self, older_than: float) -> None:
        """Forget what ended sandboxes left behind (kept for inspection) older than this."""

    async def release_node(self) -> None:
        """The edge closes with no live sandbox: free node-wide caches (mounts, templates)."""


class Snapshots(ABC):
    """Save a running sandbox so new ones can be restored from it."""

    @abstractmethod
    async def snapshot(self, sandbox_id: str, snapshot_id: str, meta: dict[str, Any]) -> int:
        """Take it; returns the bytes the snapshot holds."""

    @abstractmethod
    def snapshot_record(self, snapshot_id: str) -> dict[str, Any]: ...

    @abstractmethod
    def snapshot_records(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    async def delete_snapshot(self, snapshot_id: str) -> None: ...


class Parking(ABC):
    """Park a sandbox off the CPU and out of memory, keeping its state; unpark it in place."""

    @abstractmethod
    async def park(self, sandbox_id: str) -> int:
        """Returns the bytes the parked state takes."""

    @abstractmethod
    async def unpark(self, sandbox_id: str) -> None: ...


class VolumeDirs(ABC):
    """Where this node keeps volumes (dsec.volumes): directories with a byte quota, on the
    backend's scratch filesystem so that its quota mechanism applies (btrfs qgroups)."""

    volumes_enforced: bool          # True: writes beyond the quota fail (EDQUOT); False: measured

    @abstractmethod
    def volume_root(self) -> Path: ...

    @abstractmethod
    def make_volume_dir(self, d: Path, limit_bytes: int) -> None:
        """Create `d` (not there yet) with that quota where the filesystem can enforce it."""

    @abstractmethod
    def remove_volume_dir(self, d: Path) -> None: ...

    @abstractmethod
    def volume_usage(self, d: Path) -> int:
        """Bytes the directory holds (never following symlinks)."""


class Hibernation(ABC):
    """Parking that tears a quiescent sandbox down to its files (nothing of it left in memory);
    Parking.unpark starts it again. Tried by the edge before Parking.park when no exec output
    waits in the agent."""

    @abstractmethod
    async def hibernate(self, sandbox_id: str) -> int | None:
        """Park it to disk if nothing but its agent runs in it: the bytes it held in memory; or
        None, with nothing changed, when it is not quiescent (then it is parked in memory)."""


class Reclaim(ABC):
    """Push a running sandbox's memory out of RAM (page cache dropped, anonymous memory to
    swap) while it keeps running: what the edge does to sandboxes idle for a while
    (edge/reclaim.py). Must not stop, throttle or OOM-kill anything of the sandbox."""

    @abstractmethod
    async def reclaim(self, sandbox_id: str) -> int:
        """Returns the bytes that left RAM (what its tasks touch again comes back)."""


DOZE_BUSY = -2     # Doze.doze: it works right now (CPU over a look): ask again later


class Doze(ABC):
    """Stop an idle sandbox's CPU (and push its memory out) while nobody uses it; the edge
    wakes it before every use. The edge's idle reclaim asks (edge/reclaim.py) once a sandbox
    is idle and nothing is in flight; `doze` must mark the sandbox dozing before its first
    await, so a request that arrives meanwhile finds it so and its `wake` waits for the doze."""

    @abstractmethod
    async def doze(self, sandbox_id: str, pageout: bool = True) -> int:
        """Returns the bytes that left RAM; -1 when it cannot doze (not eligible), DOZE_BUSY
        when it worked over the look (the reclaimer asks again one idle threshold later).
        `pageout=False`: stop its CPU only (the host is short of CPU, not memory); asked again
        with pageout while it still dozes, it pushes the memory out then (D100)."""

    @abstractmethod
    async def wake(self, sandbox_id: str) -> bool:
        """Run it again if it dozes (a set lookup when not). True: it dozed (the guest's
        clock stood still: the caller sets it)."""

    @abstractmethod
    def dozing(self, sandbox_id: str) -> bool:
        """Whether it dozes now (its agent does not answer until woken: no liveness pings)."""


@dataclass(frozen=True)
class UpperView:
    """A frozen sandbox's writable layer, as the host sees it."""

    path: Path
    map_id: Callable[[int], int] | None     # host id -> id inside the sandbox (user namespaces)
    # layers under it that are the sandbox's too (a fork's snapshot layers, oldest first), each
    # with its own id mapping: packed as layers of their own below the upper's
    below: tuple[tuple[Path, Callable[[int], int] | None], ...] = ()


class SnapshotLayers(ABC):
    """A snapshot that is files only (containers): its layers can be packed as an image that
    another node creates from (VM snapshots hold memory and devices, and stay on their node)."""

    @abstractmethod
    def snapshot_layers(self, snapshot_id: str) -> tuple[UpperView, dict[str, Any]]:
        """Its topmost layer (the earlier ones of its chain in `below`) and its meta (image,
        project, args). Read-only files: nothing needs freezing. File I/O: call in a thread."""


class LayerDiff(ABC):
    """Read a sandbox's writable layer (pack_diff)."""

    @abstractmethod
    def frozen_upper(self, sandbox_id: str) -> AbstractAsyncContextManager[UpperView]:
        """The writable layer with the sandbox frozen: it cannot change it mid-read."""


class Egress(ABC):
    """A per-sandbox network egress policy that can change while it runs."""

    @abstractmethod
    async def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        """Replace the policy (InvalidArgument for unknown rule sets; FileNotFoundError if the
        sandbox is gone)."""

    def set_rulesets(self, sets: dict[str, NetworkRuleSet]) -> None:
        """Replace the operator's named rule sets this backend resolves (from the control store)."""
        return None

    def known_rulesets(self) -> set[str]:
        return set()


class EgressSecrets(ABC):
    """Secrets added to a sandbox's outbound requests by the node's egress proxy (issue 30)."""

    @abstractmethod
    async def set_egress_secrets(self, sandbox_id: str, rules: list) -> None:
        """Replace the sandbox's rules (dsec.types.EgressSecret)."""

    @abstractmethod
    def revoke_egress_secret(self, secret_id: str) -> int:
        """Drop a rule from every sandbox of this node; how many held it."""


class PortIngress(ABC):
    """TCP ports inside a running sandbox reachable from the edge (HTTP/WebSocket ingress),
    whatever the sandbox's own network policy: the connection is made from the host side."""

    @abstractmethod
    async def open_port(self, sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to `port` on the sandbox's loopback. ConnectionRefusedError when
        nothing listens there; FileNotFoundError if the sandbox is gone."""


class Console(ABC):
    """A console log kept with the record (failed sandboxes too)."""

    @abstractmethod
    def console(self, sandbox_id: str, tail: int) -> bytes: ...


class MemoryUsage(ABC):
    """What a running sandbox costs the host now."""

    @abstractmethod
    def pss(self, sandbox_id: str) -> int | None: ...

    def swapped(self, sandbox_id: str) -> int | None:
        """Bytes of the sandbox in swap (a parked container's memory), if the backend knows."""
        return None


@dataclass(frozen=True)
class RawUsage:
    """What a sandbox has used, as its runtime counts it (cumulative CPU; the rest now)."""

    cpu_ns: int                   # CPU time used since it started
    mem_bytes: int                # memory charged to it, page cache included
    mem_cache: int                # of which page cache
    disk_bytes: int | None        # bytes in its writable layer (None: not known cheaply)
    net_rx: int | None = None     # bytes received / sent (None: no network device)
    net_tx: int | None = None


class UsageStats(ABC):
    """Usage figures of a running sandbox, cheap enough to sample every few seconds
    (edge/usage.py): container cgroups, a VM's QEMU process."""

    @abstractmethod
    def usage(self, sandbox_id: str) -> RawUsage | None:
        """None when it cannot be read now (parked to disk, gone). Blocking: call in a thread."""


class LivenessWatched(ABC):
    """Sandboxes whose death the edge must notice between requests (a VM's QEMU exits, a
    guest hangs): each reap tick checks is_running, and every `ping_interval_s` the agent
    is pinged; `ping_misses` unanswered pings in a row fail the sandbox."""

    ping_interval_s: float = 15.0
    ping_timeout_s: float = 5.0
    ping_misses: int = 3

