"""Shared wire and domain types.

Every layer (sdk, apiserver, edge, backends, images) imports this module; it imports
nothing of theirs. The HTTP API *is* these models: FastAPI derives the OpenAPI schema from
them and the SDK sends and parses them.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      ValidationInfo, WithJsonSchema, field_validator)

# ---------------------------------------------------------------------------------------
# Errors: every failure a user can cause names the field and the fix.
# ---------------------------------------------------------------------------------------


class DsecError(Exception):
    """A failure with a stable code, the offending field (if any) and how to fix it."""

    status: int = 400
    code: str = "bad_request"

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.fix = fix

    def to_body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "field": self.field,
                          "fix": self.fix}}


class InvalidArgument(DsecError):
    status, code = 422, "invalid_argument"


class NotFound(DsecError):
    status, code = 404, "not_found"


class Unauthorized(DsecError):
    status, code = 401, "unauthorized"


class Forbidden(DsecError):
    status, code = 403, "forbidden"


class Conflict(DsecError):
    """The target exists but is in a state that does not allow the operation."""

    status, code = 409, "conflict"


class CapacityExceeded(DsecError):
    """Admission refused: the node (or quota) is full. Callers may place elsewhere."""

    status, code = 429, "capacity_exceeded"


class SandboxFailed(DsecError):
    # 502: the sandbox (the upstream of this request) failed, not the server (500 is for bugs)
    status, code = 502, "sandbox_failed"


class Unavailable(DsecError):
    status, code = 503, "unavailable"


class NodeUnreachable(Unavailable):
    """A node's edge did not answer. `delivered` False: the request never reached it (the
    connection was refused or not made), so placement may try another node; True: it may have
    taken effect there."""

    delivered: bool = True


class PayloadTooLarge(DsecError):
    """The request body is larger than its route accepts (the apiserver's body limits)."""

    status, code = 413, "payload_too_large"


class BadGateway(DsecError):
    """A server inside a sandbox answered with something that is not valid HTTP (port ingress)."""

    status, code = 502, "bad_gateway"


class GatewayTimeout(DsecError):
    """A server inside a sandbox accepted the connection but did not answer in time."""

    status, code = 504, "gateway_timeout"


class InternalError(DsecError):
    """A bug in dsec, not in the request: the server log has the details."""

    status, code = 500, "internal"


ERRORS_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls for cls in (DsecError, InvalidArgument, NotFound, Unauthorized, Forbidden,
                              Conflict, CapacityExceeded, SandboxFailed, Unavailable, PayloadTooLarge,
                              BadGateway, GatewayTimeout, InternalError)
}


class ErrorDetail(BaseModel):
    code: str = Field(description="stable code, e.g. 'invalid_argument', 'not_found', 'conflict'")
    message: str
    field: str | None = Field(description="the request field at fault (dotted path), if any")
    fix: str | None = Field(description="what to change so that the request succeeds, if known")


class ErrorBody(BaseModel):
    """The body of every error response (DsecError.to_body)."""

    error: ErrorDetail


# ---------------------------------------------------------------------------------------
# Identifiers: a sandbox id encodes the node that owns it, so any apiserver can forward.
# ---------------------------------------------------------------------------------------

NODE_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")
SANDBOX_ID_RE = re.compile(r"^sb-(?P<node>[a-z0-9][a-z0-9-]{0,30})\.(?P<rand>[0-9a-f]{12})$")


def make_sandbox_id(node_id: str) -> str:
    if not NODE_ID_RE.match(node_id):
        raise InvalidArgument(f"bad node id {node_id!r}", field="node_id",
                              fix="use lowercase letters, digits and '-', at most 31 chars")
    return f"sb-{node_id}.{secrets.token_hex(6)}"


SNAPSHOT_ID_PATTERN = r"^snap-[a-z0-9][a-z0-9-]{0,30}\.[0-9a-f]{12}$"


def make_snapshot_id(node: str) -> str:
    return f"snap-{node}.{secrets.token_hex(6)}"


def node_of_snapshot(snapshot_id: str) -> str:
    if not re.match(SNAPSHOT_ID_PATTERN, snapshot_id):
        raise NotFound(f"no snapshot {snapshot_id!r}: not a snapshot id", field="snapshot",
                       fix="use an id returned by Sandbox.snapshot(), e.g. 'snap-node0.0123456789ab'")
    return snapshot_id.removeprefix("snap-").rsplit(".", 1)[0]


def node_of(sandbox_id: str) -> str:
    m = SANDBOX_ID_RE.match(sandbox_id)
    if not m:
        raise NotFound(f"no sandbox {sandbox_id!r}: not a sandbox id", field="sandbox_id",
                       fix="use an id returned by create, e.g. 'sb-node0.0123456789ab'")
    return m.group("node")


# ---------------------------------------------------------------------------------------
# Sandbox arguments: one type per backend, no fake uniformity.
# ---------------------------------------------------------------------------------------

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._@:+-]{0,127}$"
MAX_TTL_S = 7 * 24 * 3600
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_ENV_VARS = 1024
MAX_ENV_BYTES = 128 * 1024      # names and values together, as labels are bounded (a 900 KB env was taken)


def _check_env(env: dict[str, str]) -> dict[str, str]:
    if len(env) > MAX_ENV_VARS:
        raise ValueError(f"{len(env)} environment variables: at most {MAX_ENV_VARS}")
    size = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())
    if size > MAX_ENV_BYTES:
        raise ValueError(f"the environment is {size} bytes: at most {MAX_ENV_BYTES} (names and values); "
                         "put large data in a file instead")
    for k, v in env.items():
        if not ENV_KEY_RE.match(k):
            raise ValueError(f"environment variable name {k!r} is not valid: use [A-Za-z_][A-Za-z0-9_]*")
        if "\0" in v or "\0" in k:
            raise ValueError(f"environment variable {k!r} contains a NUL byte")
    return env


# Field types shared by argument models: one definition of what a field means wherever it is.
Env = Annotated[dict[str, str], AfterValidator(_check_env)]
USER_RE = r"^(root|sandbox|[0-9]{1,9}(:[0-9]{1,9})?)$"


# Validation context for arguments read back from a node's records: bounds added after they
# were stored are not applied to them (a record must always load), only to new requests.
STORED: dict[str, Any] = {"dsec_stored": True}


def _stored(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and bool(info.context.get("dsec_stored"))


def _check_user(user: str | None, info: ValidationInfo) -> str | None:
    """A non-root uid never runs with group root: gid 0 owns host-root-group files and is
    what many in-image checks treat as privileged. 'root', '0' and '0:0' are root."""
    if user is not None and not _stored(info):
        uid, sep, gid = user.partition(":")
        if sep and uid.isdigit() and gid.isdigit() and int(gid) == 0 and int(uid) != 0:
            raise ValueError(f"user {user!r} would run uid {int(uid)} with group root (gid 0): use "
                             f"'{int(uid)}' (gid = uid), '{int(uid)}:GID' with GID > 0, or 'root'")
    return user


MAX_LABELS = 64
MAX_LABEL_VALUE = 256
LABEL_KEY_RE = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$"


def _check_labels(v: object, info: ValidationInfo) -> object:
    """Runs before the typed checks so that errors are short and name the label (a huge key
    would otherwise be echoed back in the error's field path)."""
    if not isinstance(v, dict):
        return v
    if _stored(info):     # stored before labels were bounded: kept as they are
        return {str(k): str(val) for k, val in v.items()}
    if len(v) > MAX_LABELS:
        raise ValueError(f"{len(v)} labels, at most {MAX_LABELS}: keep labels for selecting sandboxes "
                         "and put bulk data in a file inside the sandbox")
    for k, val in v.items():
        if not isinstance(k, str) or not re.match(LABEL_KEY_RE, k):
            raise ValueError(f"label key {str(k)[:70]!r} must be 1-63 characters of A-Z a-z 0-9 . _ / -, "
                             "starting with a letter or digit")
        if isinstance(val, str) and len(val) > MAX_LABEL_VALUE:
            raise ValueError(f"label {k!r} has a value of {len(val)} characters, at most {MAX_LABEL_VALUE}: "
                             "put bulk data in a file inside the sandbox")
    return v


ImageRef = Annotated[str, Field(pattern=NAME_RE, description="image name or sha256 digest")]
SandboxUser = Annotated[str | None, Field(description="None: non-root 'sandbox' (uid 1000); 'root' (= '0' = '0:0'); "
                                                      "or 'UID[:GID]' (a non-root UID never with GID 0)",
                                          pattern=USER_RE), AfterValidator(_check_user)]
# Enforced by _check_labels alone (so that stored records load); the schema says the same.
Labels = Annotated[dict[str, str], BeforeValidator(_check_labels), WithJsonSchema({
    "type": "object", "maxProperties": MAX_LABELS, "propertyNames": {"pattern": LABEL_KEY_RE},
    "additionalProperties": {"type": "string", "maxLength": MAX_LABEL_VALUE},
    "description": f"at most {MAX_LABELS}; keys 1-63 chars [A-Za-z0-9._/-], values at most {MAX_LABEL_VALUE} chars"})]
IdleTtl = Annotated[int, Field(gt=0, le=MAX_TTL_S, description="reap after this long without a request")]
Lifetime = Annotated[float | None, Field(gt=0, le=MAX_TTL_S,
                                         description="absolute lifetime, s: the sandbox is stopped this long after "
                                                     "creation, busy or not (extend with set_timeout); None: only "
                                                     "the idle TTL ends it")]
IDEMPOTENCY_KEY_RE = r"^[A-Za-z0-9_.:-]{1,128}$"
SDK_KEY_PREFIX = "sdk-"     # idempotency keys the SDK makes for its own resends (kept an hour, not a week)
IdempotencyKey = Annotated[str | None, Field(pattern=IDEMPOTENCY_KEY_RE,
                                             description="a retried request with the same key (same project or "
                                                         "sandbox) returns the first one's result instead of "
                                                         "running again")]
OutputCap = Annotated[int, Field(ge=1024, le=64 * 1024 * 1024,
                                 description="per stream per command; beyond it output is dropped and reported")]


PORT_RANGE_RE = re.compile(r"^\s*(\d{1,5})\s*(?:-\s*(\d{1,5})\s*)?$")
RULESET_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class NetworkRule(_Strict):
    """Allow egress to a destination network, optionally only some ports and one protocol."""

    cidr: Annotated[str, Field(max_length=64, description="IPv4 or IPv6 network or address: '10.0.0.0/8', "
                                                          "'2001:db8::/32', '151.101.1.1'")]
    ports: Annotated[list[int | str] | int | str | None,
                     Field(description="omitted: all ports; 443, [80, 443], '8000-8100' or [443, '8000-8100']")] = None
    protocol: Literal["tcp", "udp", "any"] = "any"

    @field_validator("cidr")
    @classmethod
    def _valid_cidr(cls, v: str) -> str:
        try:
            return str(ipaddress.ip_network(v.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{v!r} is not an IPv4/IPv6 network; use e.g. '10.0.0.0/8', '1.2.3.4' or '2001:db8::/32'") from None

    @field_validator("ports", mode="before")
    @classmethod
    def _valid_ports(cls, v: object) -> object:
        if v is None:
            return None
        items = v if isinstance(v, list) else [v]
        if not items:
            raise ValueError("ports must not be empty; omit it to allow all ports")
        out: list[int | str] = []
        for p in items:
            if isinstance(p, bool) or not isinstance(p, (int, str)):
                raise ValueError(f"port {p!r} must be a number 1-65535 or a range 'LO-HI'")
            m = PORT_RANGE_RE.match(str(p))
            if not m:
                raise ValueError(f"port {p!r} must be a number 1-65535 or a range 'LO-HI'")
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if not (1 <= lo <= hi <= 65535):
                raise ValueError(f"port range {p!r} must lie within 1-65535 with LO <= HI")
            out.append(lo if lo == hi else f"{lo}-{hi}")
        return out

    def port_ranges(self) -> list[tuple[int, int]]:
        if self.ports is None:
            return [(0, 65535)]
        ports = self.ports if isinstance(self.ports, list) else [self.ports]
        out = []
        for p in ports:
            lo, _, hi = str(p).partition("-")
            out.append((int(lo), int(hi or lo)))
        return out


class NetworkPolicy(_Strict):
    """Egress allow-list of a sandbox. Empty (the default) denies everything but loopback."""

    rules: Annotated[list[NetworkRule], Field(max_length=256)] = Field(default_factory=list)
    rulesets: Annotated[dict[Annotated[str, Field(pattern=RULESET_NAME_RE)], bool],
                        Field(description="named rule sets defined by the operator, e.g. {'pypi': true, 'npm': false}")
                        ] = Field(default_factory=dict)


class ContainerArgs(_Strict):
    """A crun container over overlayfs on read-only EROFS layers."""

    backend: Literal["container"] = "container"
    image: ImageRef
    workspace: Annotated[str | None, Field(pattern=NAME_RE,
                                           description="workspace layer(s) above the base, e.g. 'django-15388@v2'")] = None
    toolkits: Annotated[list[Annotated[str, Field(pattern=NAME_RE)]],
                        Field(max_length=32, description="toolkit layers above the workspace, in order: the last is topmost")
                        ] = Field(default_factory=list)
    cpu_cores: Annotated[float, Field(gt=0, le=64, description="CPU in cores: the cgroup weight under contention and the CFS quota ceiling (never below the node floor DSEC_CPU_QUOTA_FLOOR_CORES, default 0.1)")] = 1.0
    cpu_class: Annotated[Literal["latency", "batch"], Field(
        description="CPU QoS class. latency: CPU weight proportional to cpu_cores; batch = best effort: "
                    "runs only on CPU that latency sandboxes leave idle (SCHED_IDLE, minimum weight)")] = "latency"
    memory_mb: Annotated[int, Field(ge=16, le=256 * 1024, description="memory limit, MiB")] = 512
    pids_limit: Annotated[int, Field(ge=8, le=65536)] = 1024
    disk_mb: Annotated[int, Field(ge=64, le=1024 * 1024,
                                  description="quota of the writable layer, MiB: writes beyond it fail with EDQUOT")] = 10240
    nofile: Annotated[int, Field(ge=64, le=65536, description="open files per process of every command (RLIMIT_NOFILE)")] = 4096
    max_file_mb: Annotated[int | None, Field(ge=1, le=1024 * 1024,
                                             description="largest file a command may write (RLIMIT_FSIZE); None: no limit")] = None
    ttl_idle_s: IdleTtl = 600
    suspend_idle_s: Annotated[int | None, Field(gt=0, le=MAX_TTL_S,
                                                description="park the sandbox after this long without a request "
                                                            "(frozen, memory pushed to compressed swap; the next "
                                                            "request resumes it); None: never")] = None
    lifetime_s: Lifetime = None
    idempotency_key: IdempotencyKey = None
    user: SandboxUser = None
    workdir: Annotated[str, Field(pattern=r"^/[^\x00]{0,255}$")] = "/work"
    env: Env = Field(default_factory=dict)
    output_cap_bytes: OutputCap = 1024 * 1024
    output_total_bytes: Annotated[int, Field(ge=1024 * 1024, le=16 * 1024 ** 3,
                                             description="stdout+stderr a sandbox may deliver over its life; beyond it "
                                                         "commands still run but deliver nothing "
                                                         "(ExecResult.output_budget_exhausted)")] = 1024 ** 3
    labels: Labels = Field(default_factory=dict)
    network: NetworkPolicy = Field(default_factory=NetworkPolicy,
                                   description="egress allow-list (cgroup-BPF); default: deny all but loopback")


class _VMArgs(_Strict):
    """Fields shared by the QEMU backends (dsec.backends.vm). The guest boots the same EROFS
    layers as containers (read-only disks shared by every VM on the node) under an overlay
    with a private writable disk. There is no network device: a VM has no egress at all."""

    image: ImageRef
    workspace: Annotated[str | None, Field(pattern=NAME_RE, description="workspace layer above the base")] = None
    toolkits: Annotated[list[Annotated[str, Field(pattern=NAME_RE)]],
                        Field(max_length=16, description="toolkit layers above the workspace; the last is topmost")
                        ] = Field(default_factory=list)
    vcpus: Annotated[int, Field(ge=1, le=16, description="virtual CPUs of the guest")] = 1
    memory_mb: Annotated[int, Field(ge=128, le=64 * 1024, description="guest RAM, MiB")] = 512
    disk_mb: Annotated[int, Field(ge=64, le=1024 * 1024,
                                  description="size of the guest's writable disk, MiB (sparse on the host)")] = 2048
    ttl_idle_s: IdleTtl = 600
    lifetime_s: Lifetime = None
    idempotency_key: IdempotencyKey = None
    suspend_idle_s: Annotated[int | None, Field(gt=0, le=MAX_TTL_S,
                                                description="park the VM on disk after this long without a request "
                                                            "(memory freed; the next request resumes it); None: never")] = None
    user: SandboxUser = None
    workdir: Annotated[str, Field(pattern=r"^/[^\x00 ]{0,255}$")] = "/work"
    env: Env = Field(default_factory=dict)
    output_cap_bytes: OutputCap = 1024 * 1024
    labels: Labels = Field(default_factory=dict)
    accel: Literal["auto", "kvm", "tcg"] = Field(
        "auto", description="auto: KVM when it boots a guest on this node, else TCG software emulation")
    clone: bool = Field(True, description="start as a copy-on-write clone of the environment's template "
                                          "snapshot (fast, shares memory); False: cold boot")
    snapshot: Annotated[str | None, Field(pattern=SNAPSHOT_ID_PATTERN,
                                          description="restore a snapshot taken with Sandbox.snapshot() as a "
                                                      "new sandbox (image/layers/size come from the snapshot)")] = None

    @property
    def cpu_cores(self) -> float:   # what placement and admission count
        return float(self.vcpus)


class MicroVMArgs(_VMArgs):
    """A QEMU `microvm` (virtio-mmio, no PCI, no firmware): the VM boundary at low cost."""

    backend: Literal["microvm"] = "microvm"


class VMArgs(_VMArgs):
    """A full QEMU `q35` VM (PCI, ACPI). Read-only layers go in as virtio-pmem with DAX, so
    the guest maps the host's page cache instead of keeping its own copy."""

    backend: Literal["vm"] = "vm"
    pmem: bool = Field(True, description="layers as virtio-pmem + DAX (False: virtio-blk like microvm)")
    disk: Annotated[str | None, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$",
                                      description="boot this VM disk (`dsec vm disk build NAME --image IMAGE`): "
                                                  "the image's own kernel and init (e.g. systemd) on a qcow2 "
                                                  "root, always a cold boot (no template clone); `image` must "
                                                  "be the disk's image; no workspace/toolkits")] = None

    @field_validator("disk")
    @classmethod
    def _disk_alone(cls, v: str | None, info: ValidationInfo) -> str | None:
        # a disk is one finished filesystem: there is nothing to stack layers onto
        if v is not None:
            extra = [f for f in ("workspace", "toolkits", "snapshot") if info.data.get(f)]
            if extra:
                raise ValueError(f"a VM booted from disk {v!r} cannot also have {', '.join(extra)}: the disk is "
                                 "one finished filesystem; build a disk from an image that has what you need")
        return v


# Union of all backend argument types (discriminated on `backend`).
def _backend_of(v: object) -> str:
    """The discriminator; a body without `backend` is a container (the first backend)."""
    return v.get("backend", "container") if isinstance(v, dict) else getattr(v, "backend", "container")


SandboxArgs = Annotated[Union[Annotated[ContainerArgs, Tag("container")], Annotated[MicroVMArgs, Tag("microvm")],
                              Annotated[VMArgs, Tag("vm")]], Discriminator(_backend_of)]
VM_BACKENDS = ("microvm", "vm")


class SandboxState(str, Enum):
    creating = "creating"
    running = "running"
    suspended = "suspended"    # VM parked on disk (no host memory); the next request resumes it
    stopping = "stopping"
    stopped = "stopped"
    failed = "failed"


class SandboxInfo(BaseModel):
    id: str
    node: str
    project: str
    backend: str
    state: SandboxState
    image: str
    image_digest: str | None = None
    cpu_cores: float
    memory_mb: int
    ttl_idle_s: int
    created_at: datetime
    last_active_at: datetime
    expires_at: datetime | None = Field(None, description="when the absolute lifetime ends it (lifetime_s, "
                                                          "set_timeout); None: only the idle TTL")
    error: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    network: NetworkPolicy | None = Field(None, description="current egress policy (container sandboxes)")
    accel: str | None = Field(None, description="VM sandboxes: the accelerator in use, 'kvm' or 'tcg'")
    host_swap_mb: float | None = Field(None, description="container sandboxes: its memory in (compressed) swap, "
                                                         "uncompressed size (a parked one's memory is there)")
    host_pss_mb: float | None = Field(None, description="host memory the sandbox costs now: containers, what its "
                                                        "memory cgroup is charged; VMs, the PSS of its "
                                                        "QEMU (shared pages counted in part)")


class BulkSelector(_Strict):
    """Which sandboxes a bulk call acts on: the caller's sandboxes carrying all these labels."""

    labels: Annotated[Labels, Field(min_length=1, description="e.g. {'job': 'run-17'}: every one of the caller's "
                                                              "sandboxes with all of these labels")]


class BulkItem(BaseModel):
    id: str
    state: SandboxState | None = None
    error: str | None = Field(None, description="why this one did not change (the others did)")


class BulkResult(BaseModel):
    sandboxes: list[BulkItem]


class SnapshotInfo(BaseModel):
    """A saved VM (guest memory, device state, writable disk) that restores as new sandboxes:
    `MicroVMArgs(image=..., snapshot=info.id)`. Node-local: the id names its node."""

    id: str
    node: str
    sandbox_id: str = Field(description="the sandbox it was taken from")
    backend: str
    image: str
    project: str = Field(description="the project of the sandbox it was taken from: it and its ancestors "
                                     "may restore, list and delete it")
    size_bytes: int = Field(description="bytes of its own on the node's disk (state file + disk delta; "
                                        "the base disks it shares with its source are not counted)")
    created_at: datetime


class SnapshotList(BaseModel):
    snapshots: list[SnapshotInfo]


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]
    unreachable_nodes: list[str] = Field(default_factory=list, description=(
        "nodes that did not answer in time: their sandboxes are listed as last known (their state "
        "may have changed since)"))


# ---------------------------------------------------------------------------------------
# Exec, sessions, files.
# ---------------------------------------------------------------------------------------

MAX_EXEC_TIMEOUT_S = 24 * 3600


class ExecRequest(_Strict):
    cmd: Annotated[str, Field(min_length=1, max_length=1024 * 1024, description="run by the image's shell (-c)")]
    session: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                                         description="persistent shell session name; cwd and env survive between calls")] = None
    cwd: Annotated[str | None, Field(pattern=r"^/[^\x00]{0,4095}$")] = None
    env: Env = Field(default_factory=dict)
    timeout_s: Annotated[float, Field(gt=0, le=MAX_EXEC_TIMEOUT_S)] = 300.0
    stdin: Annotated[str | None, Field(max_length=16 * 1024 * 1024, description="text fed to stdin, then closed")] = None
    output_cap_bytes: Annotated[int | None, Field(ge=1024, le=64 * 1024 * 1024)] = None
    user: Annotated[str | None, Field(pattern=USER_RE, description="None: the sandbox's user"),
                    AfterValidator(_check_user)] = None
    keep_stdin: bool = Field(False, description="stdin stays open after `stdin` for later writes "
                                                "(POST .../execs/{id}/stdin); closed by a write with close=true")
    tag: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
                                     description="a free label shown in list_execs")] = None
    idempotency_key: IdempotencyKey = None

    @field_validator("cmd")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\0" in v:
            raise ValueError("cmd must not contain a NUL byte")
        return v


class ExecResult(BaseModel):
    exec_id: str
    exit_code: int | None = Field(description="None when killed by a signal")
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    truncated: bool = Field(False, description="output exceeded output_cap_bytes; the rest was dropped")
    stdout_bytes: int = Field(0, description="bytes the command wrote to stdout, including dropped ones")
    stderr_bytes: int = 0
    session_ended: bool = Field(False, description="the session shell exited (exit, timeout); next call starts a new one")
    duration_s: float = 0.0
    output_budget_exhausted: bool = Field(False, description="the sandbox's output_total_bytes is spent: this "
                                                             "command's output was cut short or dropped")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class ExecInfo(BaseModel):
    """A command started in a sandbox (list_execs, start_exec)."""

    exec_id: str
    cmd: str = Field("", description="empty for a command started before the edge restarted")
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    tag: str | None = None
    session: str | None = None
    running: bool = True
    detached: bool = Field(False, description="started with start_exec: its output is kept for followers")
    stdin_open: bool = False
    started_at: datetime | None = None
    exit_code: int | None = None
    signal: int | None = None


class ExecList(BaseModel):
    execs: list[ExecInfo]


class SignalRequest(_Strict):
    signal: Annotated[int, Field(ge=1, le=64, description="signal number, e.g. 15 (TERM), 9 (KILL), 2 (INT)")]


class TimeoutRequest(_Strict):
    timeout_s: Annotated[float, Field(gt=0, le=MAX_TTL_S,
                                      description="the sandbox ends this long from now (absolute lifetime)")]


class ExecEvent(BaseModel):
    """One line of a streamed exec (NDJSON). data is UTF-8 text with invalid bytes replaced."""

    type: Literal["start", "stdout", "stderr", "exit"]
    data: str = ""
    exec_id: str | None = None
    result: ExecResult | None = None


class FileWrite(_Strict):
    path: Annotated[str, Field(min_length=1, max_length=4096)]
    data_b64: str
    mode: Annotated[int, Field(ge=0, le=0o7777)] = 0o644
    mkdirs: bool = True


class FileEntry(BaseModel):
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class FsEvent(BaseModel):
    """One item of a directory watch (Edge.watch_dir): `start` once the watch is in place, then
    one per change below the directory (`overflow`: the kernel dropped events; re-list)."""
    type: Literal["start", "create", "write", "remove", "rename", "chmod", "overflow"]
    name: str = Field("", description="path relative to the watched directory")
    is_dir: bool = False


class FileList(BaseModel):
    path: str
    entries: list[FileEntry]


# ---------------------------------------------------------------------------------------
# Nodes (watcher/placement view of an edge).
# ---------------------------------------------------------------------------------------


class NodeCapacity(BaseModel):
    cpu_cores: float        # ceilings on committed limits: the node's share x the overcommit ratios
    memory_mb: int
    max_sandboxes: int
    # the edge's share of its host when not all of it (its cgroup's limits, DSEC_NODE_SHARE,
    # DSEC_NODE_CPU_CORES / DSEC_NODE_MEMORY_MB: edge/node_share.py); None: the whole host
    node_cpu_cores: float | None = None
    node_memory_mb: int | None = None


class NodeStatus(BaseModel):
    node_id: str
    healthy: bool
    backends: list[str]
    capacity: NodeCapacity
    committed_cpu_cores: float = 0.0
    committed_memory_mb: int = 0
    sandboxes: int = 0
    reason: str | None = None
    pressure: float = 0.0   # highest PSI avg10 / its admission limit: 0 idle, >= 1 the edge refuses
    # short keys (dsec.placement.locality.image_key) of images the node holds locally, most
    # recently used at most 256: placement prefers these nodes while load allows (D34)
    cached_images: frozenset[str] = frozenset()

    @property
    def load(self) -> float:
        """Fraction of the tightest resource already committed."""
        c = self.capacity
        return max(self.committed_memory_mb / max(c.memory_mb, 1),
                   self.committed_cpu_cores / max(c.cpu_cores, 1e-9),
                   self.sandboxes / max(c.max_sandboxes, 1))


# ---------------------------------------------------------------------------------------
# Images (layers are the unit; an image is an ordered list of layers, base first).
# ---------------------------------------------------------------------------------------


class LayerInfo(BaseModel):
    digest: str = Field(description="sha256:<hex> of the EROFS file")
    size_bytes: int
    created_at: datetime
    source: str = Field(description="how it was built, e.g. 'dir:/path', 'tar:/x.tgz', 'debootstrap:bookworm'")


class ImageInfo(BaseModel):
    name: str
    digest: str = Field(description="sha256 over the ordered layer digests")
    layers: list[LayerInfo]
    size_bytes: int
    created_at: datetime
    kind: str = Field("image", description="'image' (a base), or 'layer' (workspace/toolkit, NAME@VERSION)")
    owner: str | None = Field(None, description="project that owns it (visible to it and its descendants; "
                                                "only it may replace it); None: published to every project")


class ImageList(BaseModel):
    images: list[ImageInfo]


DEFAULT_SCRUB = ("/tmp", "/var/tmp", "/root/.cache", "/work/.cache", "/home/*/.cache",
                 "/root/.bash_history", "/home/*/.bash_history", "/root/.ash_history",
                 "/home/*/.ash_history", "/root/.python_history", "/home/*/.python_history",
                 "/root/.lesshst", "/home/*/.lesshst", "/root/.viminfo", "/home/*/.viminfo")


class PackDiffRequest(_Strict):
    """Turn a sandbox's writable changes into a new workspace layer NAME@VERSION."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,100}@[A-Za-z0-9._+-]{1,26}$",
                               description="NAME@VERSION of the new workspace, e.g. 'myenv@1'")]
    scrub: Annotated[list[Annotated[str, Field(pattern=r"^/[^\x00]{0,1023}$")]] | None,
                     Field(max_length=256, description="absolute paths (fnmatch globs) left out; None: DEFAULT_SCRUB")] = None
    replace: bool = False


# ---------------------------------------------------------------------------------------
# FnCall: short stateless code run in a warm pool container (dsec.fncall).
# ---------------------------------------------------------------------------------------

FNCALL_MAX_TIMEOUT_S = 3600.0     # SandboxFusion sets none; long builds and test suites need more than minutes
FNCALL_MAX_BYTES = 16 * 1024 * 1024
FNCALL_DEFAULT_IMAGE = "fncall-python"


def _check_rel_path(path: str) -> str:
    parts = path.split("/")
    if (not path or len(path) > 1024 or path.startswith("/") or "\0" in path
            or any(p in ("", ".", "..") for p in parts)):
        raise ValueError(f"file path {path!r} must be relative to the work dir, without '..', "
                         "'.', empty parts or NUL, at most 1024 chars")
    return path


class FnCallRequest(_Strict):
    """One call: code (plus stdin and files) run under its own limits in a fresh work dir."""

    backend: Literal["fncall"] = "fncall"
    code: Annotated[str, Field(max_length=FNCALL_MAX_BYTES, description="source code of the program")]
    language: Annotated[str, Field(pattern=r"^[A-Za-z0-9_+#.-]{1,32}$",
                                   description="python, bash, c, cpp, perl, ... (the image decides which exist)")] = "python"
    stdin: Annotated[str | None, Field(max_length=FNCALL_MAX_BYTES)] = None
    files: dict[str, str] = Field(default_factory=dict, description="extra text files: relative path -> content")
    files_b64: dict[str, str] = Field(default_factory=dict, description="extra binary files: relative path -> base64")
    fetch_files: Annotated[list[str], Field(max_length=64, description="files to return after the run (base64)")] = []
    args: Annotated[list[str], Field(max_length=256, description="command-line arguments of the program")] = []
    env: Env = Field(default_factory=dict)
    timeout_s: Annotated[float, Field(gt=0, le=FNCALL_MAX_TIMEOUT_S, description="wall-clock limit of the run step")] = 10.0
    compile_timeout_s: Annotated[float, Field(gt=0, le=FNCALL_MAX_TIMEOUT_S)] = 10.0
    memory_mb: Annotated[int, Field(ge=16, le=4096, description="address space the program may add (RLIMIT_AS)")] = 512
    max_processes: Annotated[int, Field(ge=1, le=1024, description="processes and threads (RLIMIT_NPROC)")] = 64
    max_file_mb: Annotated[int, Field(ge=1, le=1024, description="largest file the program may write")] = 64
    output_cap_bytes: Annotated[int, Field(ge=1024, le=FNCALL_MAX_BYTES,
                                           description="per stream; beyond it the program is killed (status output-limit)")] = 1024 * 1024
    image: Annotated[str, Field(pattern=NAME_RE, description="pool image; needs python3")] = FNCALL_DEFAULT_IMAGE

    @field_validator("files", "files_b64")
    @classmethod
    def _valid_files(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 256:
            raise ValueError("at most 256 files")
        if sum(len(x) for x in v.values()) > FNCALL_MAX_BYTES:
            raise ValueError(f"files hold more than {FNCALL_MAX_BYTES} bytes together")
        for k in v:
            _check_rel_path(k)
        return v

    @field_validator("files_b64")
    @classmethod
    def _valid_b64(cls, v: dict[str, str]) -> dict[str, str]:
        import base64
        import binascii
        for k, data in v.items():
            try:
                base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"files_b64[{k!r}] is not valid base64") from None
        return v

    @field_validator("fetch_files")
    @classmethod
    def _valid_fetch(cls, v: list[str]) -> list[str]:
        for k in v:
            _check_rel_path(k)
        return v

    @field_validator("args")
    @classmethod
    def _valid_args(cls, v: list[str]) -> list[str]:
        if any("\0" in a for a in v):
            raise ValueError("arguments must not contain NUL bytes")
        return v


class FnCallStatus(str, Enum):
    ok = "ok"
    runtime_error = "runtime-error"       # non-zero exit or killed by a signal
    compile_error = "compile-error"       # the compile step failed (Python: SyntaxError)
    timeout = "timeout"                   # wall-clock (or CPU) limit of a step
    memory = "memory"                     # memory limit
    output_limit = "output-limit"         # stdout or stderr beyond output_cap_bytes
    sandbox_error = "sandbox-error"       # the platform could not run the call; see `error`


class FnCallStep(BaseModel):
    """One step (compile or run) of a call."""

    exit_code: int | None = Field(description="None when killed by a signal")
    signal: int | None = None
    timed_out: bool = False
    output_limited: bool = False
    cached: bool = Field(False, description="compile step skipped: this container compiled the same code before")
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int = Field(0, description="bytes written, including those beyond the cap")
    stderr_bytes: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_rss_mb: float = 0.0


class FnCallResult(BaseModel):
    status: FnCallStatus
    exit_code: int | None = Field(None, description="of the last step that ran")
    signal: int | None = None
    stdout: str = ""
    stderr: str = Field("", description="of the last step that ran (the compiler's on compile-error)")
    wall_s: float = Field(0.0, description="run step wall time")
    cpu_s: float = Field(0.0, description="run step CPU time (user + system)")
    compile: FnCallStep | None = None
    run: FnCallStep | None = None
    files: dict[str, str] = Field(default_factory=dict, description="fetch_files found: path -> base64")
    language: str = ""
    error: str | None = None
    queue_s: float = Field(0.0, description="waiting for a warm container")
    total_s: float = Field(0.0, description="end to end on the node, queueing included")
    executor: str | None = Field(None, description="id of the pool container that ran it")

    @property
    def ok(self) -> bool:
        return self.status == FnCallStatus.ok


class FnCallBatch(_Strict):
    calls: Annotated[list[FnCallRequest], Field(min_length=1, max_length=1024)]


class FnCallBatchItem(BaseModel):
    """One line of the NDJSON answer to a batch, in completion order."""

    index: int
    result: FnCallResult


# ---------------------------------------------------------------------------------------
# Image builds from Dockerfiles, imports and pulls over HTTP (apiserver/image_routes.py)
# ---------------------------------------------------------------------------------------

class ImageConfig(BaseModel):
    """How an image built from a Dockerfile runs (its OCI config: ENV, WORKDIR, USER, CMD...).
    dsec applies none of it by itself: pass env/workdir to the sandbox (adapters do)."""

    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)


class ImageBuildResult(BaseModel):
    image: ImageInfo
    config: ImageConfig = Field(default_factory=ImageConfig)


class ImageProgress(BaseModel):
    """One NDJSON line of a build/import/pull: progress lines, then one with `result` or `error`."""

    message: str = ""
    fraction: float | None = None
    result: ImageBuildResult | None = None
    error: ErrorDetail | None = None


class ImagePullRequest(_Strict):
    name: Annotated[str, Field(pattern=NAME_RE, description="the dsec image name to register")]
    ref: Annotated[str, Field(min_length=1, max_length=1024, description="docker://HOST[:PORT]/REPO[:TAG]")]
    tls_verify: bool = True
    creds: Annotated[str | None, Field(max_length=1024, description="USER:PASSWORD for the registry")] = None
    replace: bool = False
