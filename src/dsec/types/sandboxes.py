"""Sandbox arguments (one type per backend, no fake uniformity), the shared field types and bounds, network policy, what a sandbox is."""

from __future__ import annotations

import ipaddress
import re
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      ValidationInfo, WithJsonSchema, field_validator, model_validator)
from dsec.types.domains import normalize_pattern
from dsec.types.ids import SNAPSHOT_ID_PATTERN
from dsec.types.volumes import VolumeMount, check_mounts


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
OnTimeout = Annotated[Literal["stop", "pause"], Field(
    description="what the end of lifetime_s (or set_timeout) does: stop ends the sandbox; pause parks it "
                "(files, processes, env kept) and its next request, native, E2B or port traffic, resumes it "
                "with a fresh lifetime_s")]
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


SOCKS_ADDRESS_RE = r"^(\[?[A-Za-z0-9.-]{1,253}\]?):([0-9]{1,5})$"


class EgressProxy(_Strict):
    """A SOCKS5 proxy the node's egress proxy carries all of the sandbox's outbound TCP through
    (E2B's `egress_proxy`), after the policy's checks; fail-closed: never direct. Set at create."""

    address: Annotated[str, Field(pattern=SOCKS_ADDRESS_RE, max_length=260,
                                  description="the SOCKS5 server, 'host:port' (a name or an IPv4 address)")]
    username: Annotated[str | None, Field(min_length=1, max_length=255,
                                          description="RFC 1929 username")] = None
    password: Annotated[str | None, Field(max_length=255, description=(
        "RFC 1929 password; never stored nor returned: the apiserver hands it to the sandbox's edge, "
        "which keeps it in memory"))] = None

    @field_validator("address")
    @classmethod
    def _port(cls, v: str) -> str:
        port = int(v.rsplit(":", 1)[1])
        if not 1 <= port <= 65535:
            raise ValueError(f"{v!r}: the port must be 1-65535")
        if v.startswith("["):
            raise ValueError(f"{v!r}: IPv6 proxies are not reachable from dsec's nodes (IPv4 only); "
                             "use a name or an IPv4 address")
        return v.lower()

    @model_validator(mode="after")
    def _auth(self) -> "EgressProxy":
        if self.password is not None and self.username is None:
            raise ValueError("password: only valid together with username")
        return self


class NetworkPolicy(_Strict):
    """Egress allow-list of a sandbox. Empty (the default) denies everything but loopback; any
    allowed egress also gives the sandbox DNS (the node's forwarder)."""

    rules: Annotated[list[NetworkRule], Field(max_length=256)] = Field(default_factory=list)
    rulesets: Annotated[dict[Annotated[str, Field(pattern=RULESET_NAME_RE)], bool],
                        Field(description="named rule sets defined by the operator, e.g. {'pypi': true, 'npm': false}")
                        ] = Field(default_factory=dict)
    domains: Annotated[list[str], Field(
        max_length=256,
        description="allow egress to these names and wildcards ('pypi.org', '*.githubusercontent.com') on "
                    "TCP 80 (HTTP Host) and 443 (TLS SNI), through the node's egress proxy; the sandbox's "
                    "DNS then answers only for them")] = Field(default_factory=list)

    egress_proxy: EgressProxy | None = Field(None, description=(
        "carry all of the sandbox's outbound TCP (what the rules and domains allow) through this SOCKS5 "
        "proxy; fail-closed. Set at create; a later set_network keeps it"))

    @field_validator("domains")
    @classmethod
    def _valid_domains(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(normalize_pattern(d) for d in v))   # ValueError names the value


class NetworkRuleSet(_Strict):
    """An operator's named rule set (`dsec ruleset set NAME ...`, PUT /v1/network/rulesets/{name}):
    CIDR rules and domain patterns that sandboxes and projects turn on by name."""

    rules: Annotated[list[NetworkRule], Field(max_length=256)] = Field(default_factory=list)
    domains: Annotated[list[str], Field(max_length=256, description="names and wildcards, as NetworkPolicy.domains")
                       ] = Field(default_factory=list)

    @field_validator("domains")
    @classmethod
    def _valid_domains(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(normalize_pattern(d) for d in v))


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
    on_timeout: OnTimeout = "stop"
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
    secrets: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, max_length=16,
        description="names of project secrets the node's egress proxy adds to this sandbox's requests to "
                    "their destinations (`dsec secret create`); the values never enter the sandbox")
    snapshot: Annotated[str | None, Field(
        pattern=SNAPSHOT_ID_PATTERN,
        description="start from a snapshot taken with Sandbox.snapshot() (its filesystem, copy-on-write): image, "
                    "layers, limits, env, workdir, labels and network policy come from it unless given here")] = None
    volumes: Annotated[list[VolumeMount], AfterValidator(check_mounts),
                       Field(description="volumes of the sandbox's project to mount (client.create_volume)")
                       ] = Field(default_factory=list)


class _VMArgs(_Strict):
    """Fields shared by the QEMU backends (dsec.backends.vm). The guest boots the same EROFS
    layers as containers (read-only disks shared by every VM on the node) under an overlay
    with a private writable disk. A network device only when `network` is given (even empty):
    the guest's traffic leaves through its QEMU (user-mode networking) under the same node
    policy as containers (docs/vm.md, "Network")."""

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
    on_timeout: OnTimeout = "stop"
    idempotency_key: IdempotencyKey = None
    suspend_idle_s: Annotated[int | None, Field(gt=0, le=MAX_TTL_S,
                                                description="park the VM on disk after this long without a request "
                                                            "(memory freed; the next request resumes it); None: never")] = None
    user: SandboxUser = None
    workdir: Annotated[str, Field(pattern=r"^/[^\x00 ]{0,255}$")] = "/work"
    env: Env = Field(default_factory=dict)
    output_cap_bytes: OutputCap = 1024 * 1024
    labels: Labels = Field(default_factory=dict)
    volumes: list[dict[str, Any]] = Field(default_factory=list, description="not available for VMs (see the error)")
    network: NetworkPolicy | None = Field(
        None, description="egress policy, as for containers (rules, domains, rule sets; enforced on the node, "
                          "DNS through the node's forwarder); None: the VM has no network device at all and "
                          "set_network is refused (pass an empty policy to change it later)")
    accel: Literal["auto", "kvm", "tcg"] = Field(
        "auto", description="auto: KVM when it boots a guest on this node, else TCG software emulation")
    clone: bool = Field(True, description="start as a copy-on-write clone of the environment's template "
                                          "snapshot (fast, shares memory); False: cold boot")
    snapshot: Annotated[str | None, Field(pattern=SNAPSHOT_ID_PATTERN,
                                          description="restore a snapshot taken with Sandbox.snapshot() as a "
                                                      "new sandbox (image/layers/size come from the snapshot)")] = None

    @field_validator("volumes")
    @classmethod
    def _no_volumes(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if v:
            # the guest kernel has no 9p; virtiofs (virtiofsd) needs shared guest memory and QEMU 7.2
            # cannot migrate it: no template clone, snapshot, fork or park of such a VM (D6x)
            raise ValueError("volumes: VM sandboxes cannot mount volumes (the guest kernel has no 9p, and a "
                             "virtiofs device would stop this VM from being cloned, snapshotted, forked or "
                             "parked); mount the volume in a container sandbox (backend 'container'), or copy "
                             "files between the volume and the VM with the volume file API (`dsec volume cp`, "
                             "Volume.read_file/write_file) and the sandbox's files API")
        return v

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
    on_timeout: str = Field("stop", description="what the end of its lifetime does: stop, or pause (auto-pause)")
    volumes: list[VolumeMount] = Field(default_factory=list, description="the volumes it mounts")
    error: str | None = None
    end_reason: str | None = Field(None, description="why it ended, one word of docs/events.md's vocabulary "
                                                     "(error keeps the free-text message)")
    labels: dict[str, str] = Field(default_factory=dict)
    network: NetworkPolicy | None = Field(None, description="current egress policy (containers; VMs created with a network)")
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
    """A saved sandbox that new sandboxes start from: a VM's guest memory, device state and
    writable disk (`MicroVMArgs(image=..., snapshot=info.id)`), or a container's filesystem
    (`ContainerArgs(image=..., snapshot=info.id)`). Node-local: the id names its node."""

    id: str
    node: str
    sandbox_id: str = Field(description="the sandbox it was taken from")
    backend: str
    image: str
    project: str = Field(description="the project of the sandbox it was taken from: it and its ancestors "
                                     "may restore, list and delete it")
    size_bytes: int = Field(description="bytes of its own on the node's disk (VMs: state file + disk delta, "
                                        "the base disks it shares with its source not counted; containers: "
                                        "the files of its writable layer, shared copy-on-write; 0 in a "
                                        "fork's answer, which does not measure)")
    created_at: datetime
    name: str | None = Field(None, description="the name it was taken under ('name:tag'), if any: a name of "
                                               "the project, held by its newest snapshot (E2B's snapshot names)")


class SnapshotList(BaseModel):
    snapshots: list[SnapshotInfo]


class SnapshotImage(BaseModel):
    """A container snapshot packed as a workspace layer in the shared layer store, so that a
    node other than its own can create from it: `image` + `workspace` with the snapshot's args."""

    snapshot: str
    image: str = Field(description="the image the snapshot's source sandbox ran")
    workspace: str = Field(description="the layer (NAME@VERSION) holding the snapshot's files, "
                                       "stacked on the source's workspace")
    args: dict[str, Any] = Field(description="the source sandbox's args (env, workdir, limits ...)")


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]
    unreachable_nodes: list[str] = Field(default_factory=list, description=(
        "nodes that did not answer in time: their sandboxes are listed as last known (their state "
        "may have changed since)"))
    total: int | None = Field(None, description="sandboxes matching the filters before `limit`/`offset` "
                                                "(set when any filter or page was asked for)")
    next_offset: int | None = Field(None, description="the `offset` of the next page; None: this is the last")
