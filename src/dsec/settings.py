"""Every DSEC_* setting of the server side, typed, in one object (docs/settings.md is generated
from it: `python -m dsec.settings_doc`).

`Settings.from_env(environ)` reads the environment once, at a composition root (the embedded
server, a cluster actor or edge process, the CLI), and what it builds is passed down: no other
module reads DSEC_* names (tests/unit/test_settings.py checks the source). A group's defaults
(`AdmissionSettings()`, ...) are what a component built by hand gets. An empty value counts as
unset. A bad value is an InvalidArgument naming the variable, its value and the fix, raised at
start rather than at first use.

Built on pydantic's BaseModel, not pydantic-settings (docs/decisions.md, D47): the environment
is a parameter (tests and the cluster pass mappings), errors are dsec's own, and no dependency
is added for the ~40 lines below.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec.config import DEFAULT_HOME, Paths
from dsec.types import InvalidArgument

GiB = 1 << 30


def env(default: Any, name: str, doc: str, *, secret: bool = False, **kw: Any) -> Any:
    """A field read from the variable `name`; `doc` is its line in docs/settings.md."""
    return Field(default, alias=name, description=doc, json_schema_extra={"secret": True} if secret else None, **kw)


class Group(BaseModel):
    """One concern's settings; each field's alias is its DSEC_* name."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")
    title: typing.ClassVar[str] = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        environ = os.environ if environ is None else environ
        given = {f.alias: environ[f.alias].strip() for f in cls.model_fields.values()
                 if f.alias and environ.get(f.alias, "").strip()}
        try:
            return cls.model_validate(given)
        except ValidationError as e:
            err = e.errors()[0]
            name = str(err["loc"][0])
            f = next(f for f in cls.model_fields.values() if f.alias == name)
            raise InvalidArgument(f"{name}={given.get(name)!r}: {err['msg']}", field=name,
                                  fix=f"set {name} to {type_name(f.annotation)}, or unset it "
                                      f"(default {show_default(f.default)})") from None


class HomeSettings(Group):
    title = "Paths"
    home: Path = env(Path(DEFAULT_HOME), "DSEC_HOME", "where this node keeps its state (images, sandboxes, "
                     "databases, logs); everything else is under it")


class ClientSettings(Group):
    title = "Client (read by the SDK and the CLI's client commands themselves)"
    url: str | None = env(None, "DSEC_URL", "the server the SDK talks to; unset: http://127.0.0.1:7620, "
                          "started on first use")
    api_key: str | None = env(None, "DSEC_API_KEY", "the SDK's API key; unset: DSEC_HOME/admin.key of a "
                              "local server", secret=True)
    busy_retry_s: float = env(30.0, "DSEC_BUSY_RETRY_S", "how long in all one idempotent SDK call waits out "
                              "503/429 answers carrying Retry-After (at most 8 tries); 0: the first is raised")
    sdk_http: Literal["lean", "httpx"] = env("lean", "DSEC_SDK_HTTP", "the SDK's HTTP/1.1 under httpx: `lean` "
                                             "(its own, responses parsed by httptools; issue 29) "
                                             "for plain http://, `httpx` (httpcore/h11) for everything")


class ServerSettings(Group):
    title = "Server (apiserver)"
    log_level: str = env("INFO", "DSEC_LOG_LEVEL", "log level of cluster actors and edge processes "
                         "(`dsec up --log-level` for the embedded server)")
    idempotent_wait_s: float = env(120.0, "DSEC_IDEMPOTENT_WAIT_S", "how long a create with an idempotency "
                                   "key waits for the same key's create in flight")
    list_node_deadline_s: float = env(3.0, "DSEC_LIST_NODE_DEADLINE_S", "a listing waits this long for each "
                                      "node; later ones are reported as not answering")
    image_upload_max_bytes: int = env(16 * 1024 * (1 << 20), "DSEC_IMAGE_UPLOAD_MAX_BYTES",
                                      "largest request body of an image build or import")
    domain: str | None = env(None, "DSEC_DOMAIN", "the DNS name under which clients (native and E2B) reach "
                             "sandboxes' ports as <port>-<id>.<domain>, over HTTP and HTTPS (point *.<domain> "
                             "at the server); unset: no host routing (E2B's get_host names a .invalid host)")
    e2b_domain: str | None = env(None, "DSEC_E2B_DOMAIN", "the older name of DSEC_DOMAIN (used when "
                                 "DSEC_DOMAIN is unset)")
    https_port: int = env(8443, "DSEC_HTTPS_PORT", "with a domain set, the port HTTPS is served on (same "
                          "address as HTTP, same routes); 0: no HTTPS", ge=0, le=65535)
    tls_cert: Path | None = env(None, "DSEC_TLS_CERT", "PEM certificate (chain) for *.<domain> and <domain>; "
                                "unset: dsec makes a CA in DSEC_HOME/tls/ (distribute tls/ca.pem) and signs one")
    tls_key: Path | None = env(None, "DSEC_TLS_KEY", "PEM private key of DSEC_TLS_CERT")
    pod_name: str | None = env(None, "MY_POD_NAME", "SandboxFusion compatibility: reported as "
                               "executor_pod_name")
    create_concurrency: int = env(64, "DSEC_CREATE_CONCURRENCY", "creates an apiserver places at once; more "
                                  "wait, served round-robin between projects", ge=1)
    create_queue_max: int = env(10000, "DSEC_CREATE_QUEUE_MAX", "creates of one project waiting at an "
                                "apiserver at most; more are refused (429)", ge=0)
    create_rate_per_s: float = env(0.0, "DSEC_CREATE_RATE", "creates/s per project and apiserver of projects "
                                   "whose policy sets no max_creates_per_s (0: no limit); beyond: 429", ge=0)
    create_burst: int = env(0, "DSEC_CREATE_BURST", "creates a project may make at once above its rate "
                            "(0: one second's worth)", ge=0)
    secrets_key_file: Path | None = env(None, "DSEC_SECRETS_KEY_FILE", "the key that encrypts stored egress "
                                        "secrets (`dsec secret`), made 0600 on first use; every apiserver of a "
                                        "cluster needs the same file; unset: secrets.key beside the IAM database")

    @property
    def ingress_domain(self) -> str | None:
        """DSEC_DOMAIN, else the older DSEC_E2B_DOMAIN."""
        return self.domain or self.e2b_domain


class EventSettings(Group):
    title = "Lifecycle events and webhooks (apiserver/events.py, apiserver/webhooks.py)"
    poll_s: float = env(1.0, "DSEC_EVENTS_POLL_S", "how often the apiserver pulls new lifecycle events from "
                        "each edge into the control store", gt=0)
    webhook_timeout_s: float = env(10.0, "DSEC_WEBHOOK_TIMEOUT_S", "how long one webhook delivery waits for "
                                   "the receiver's answer", gt=0)
    webhook_backoff_max_s: float = env(300.0, "DSEC_WEBHOOK_BACKOFF_MAX_S", "the longest wait between two "
                                       "attempts of a delivery (waits double from 1 s up to this)", gt=0)
    webhook_retry_for_s: float = env(86400.0, "DSEC_WEBHOOK_RETRY_FOR_S", "how long a delivery is retried "
                                     "before it is marked failed", gt=0)
    webhook_private_ok: bool = env(False, "DSEC_WEBHOOK_PRIVATE_OK", "let every project's webhooks reach "
                                   "loopback, private and link-local addresses (else only admin keys' may)")


class ObservabilitySettings(Group):
    title = "Observability as a whole; audit log and traces (apiserver/audit.py, dsec/tracing.py)"
    enabled: bool = env(True, "DSEC_OBSERVABILITY", "0: no Prometheus metric updates (/metrics says they are "
                        "off), no background usage sampling (a sandbox's usage is read only when asked for), no "
                        "lifecycle events, webhooks or audit log (their routes answer 409); to measure what they "
                        "cost (docs/benchmarks.md) or to run without them")
    audit_retention_s: float = env(90 * 86400.0, "DSEC_AUDIT_RETENTION_S", "how long audit log entries are "
                                   "kept (pruned hourly)", gt=0)
    otlp_endpoint: str | None = env(None, "DSEC_OTLP_ENDPOINT", "send OpenTelemetry traces of creates and execs "
                                    "to this OTLP/HTTP collector (http://HOST:4318; /v1/traces is added); unset "
                                    "with DSEC_TRACES_FILE unset: no traces, no cost")
    traces_file: Path | None = env(None, "DSEC_TRACES_FILE", "append OpenTelemetry spans to this file as OTLP-JSON "
                                   "lines (one ExportTraceServiceRequest a line; tests, debugging)")
    trace_sample: float = env(1.0, "DSEC_TRACE_SAMPLE", "with traces on, the share of new traces recorded "
                              "(parent-based: a traced caller's spans are always kept)", ge=0, le=1)

    @property
    def traces_on(self) -> bool:
        return bool(self.otlp_endpoint or self.traces_file)


class AdmissionSettings(Group):
    title = "Edge admission (edge/admission.py, edge/node_share.py)"
    max_sandboxes: int = env(4000, "DSEC_MAX_SANDBOXES", "live sandboxes a node holds at most")
    cpu_overcommit: float = env(2000.0, "DSEC_CPU_OVERCOMMIT", "ceiling on committed CPU requests, as a "
                                "multiple of the node's cores")
    mem_overcommit: float = env(256.0, "DSEC_MEM_OVERCOMMIT", "ceiling on committed memory limits, as a "
                                "multiple of the node's memory")
    mem_reserve_mb: int = env(512, "DSEC_MEM_RESERVE_MB", "MemAvailable below this refuses new sandboxes "
                              "(and reports the node unhealthy)")
    sandbox_mb: int = env(8, "DSEC_ADMIT_SANDBOX_MB", "resident memory a new sandbox needs at first, on top "
                          "of the reserve")
    psi_cpu_some: float = env(100.0, "DSEC_ADMIT_PSI_CPU_SOME", "refuse while PSI cpu some avg10 (%) "
                              "reaches this (100: off)")
    psi_memory_some: float = env(20.0, "DSEC_ADMIT_PSI_MEMORY_SOME", "refuse while PSI memory some avg10 "
                                 "(%) reaches this")
    psi_memory_full: float = env(10.0, "DSEC_ADMIT_PSI_MEMORY_FULL", "refuse while PSI memory full avg10 "
                                 "(%) reaches this")
    psi_io_full: float = env(20.0, "DSEC_ADMIT_PSI_IO_FULL", "refuse while PSI io full avg10 (%) reaches this")
    # checked against the host's figures by node_share.py, which names them in its errors
    node_share: str = env("", "DSEC_NODE_SHARE", "the fraction of this host the edge may use (1/3 or "
                          "0.333); unset: all of it (`dsec cluster up` sets it per edge)")
    node_cpu_cores: str = env("", "DSEC_NODE_CPU_CORES", "CPU cores this edge may use (replaces the "
                              "share for CPU); unset: its share of the host")
    node_memory_mb: str = env("", "DSEC_NODE_MEMORY_MB", "memory (MiB) this edge may use (replaces the "
                              "share for memory); unset: its share of the host")


class EdgeEnvSettings(Group):
    title = "Edge: warm pools, idle reclaim, usage sampling (edge/warm_pool.py, edge/reclaim.py, edge/usage.py)"
    warm_pool: str = env("", "DSEC_WARM_POOL", "warm pools to keep, image:size,... e.g. "
                         "debian-python:8,busybox:4")
    warm_pool_auto: int = env(64, "DSEC_WARM_POOL_AUTO", "sandboxes the node keeps warm on its own, over all "
                              "images: a burst of >= 8 creates of one shape sets that image's pool to the burst's "
                              "size (0: off; the operator's DSEC_WARM_POOL wins for its images; D99)", ge=0, le=1024)
    warm_pool_auto_idle_s: float = env(300.0, "DSEC_WARM_POOL_AUTO_IDLE_S", "an automatic warm pool ends after "
                                       "this long without a burst of its shape; after a tenant's create was refused "
                                       "or waited, none is made for this long", gt=0)
    warm_pool_auto_margin_mb: int = env(1024, "DSEC_WARM_POOL_AUTO_MARGIN_MB", "automatic warm pools start a "
                                        "sandbox only while MemAvailable stays this far above the reserve or "
                                        "the idle-reclaim threshold (DSEC_RECLAIM_MEM_LOW_MB)", ge=0)
    warm_pool_parallel: int = env(2, "DSEC_WARM_POOL_PARALLEL", "warm containers started at a time (1..64)",
                                  ge=1, le=64)
    create_parallel: int = env(4, "DSEC_CREATE_PARALLEL", "container/VM starts run at a time on this node; "
                               "more creates wait their turn (1..256)", ge=1, le=256)
    warm_pool_reclaim: bool = env(False, "DSEC_WARM_POOL_RECLAIM", "reclaim a waiting warm container's "
                                  "touched memory to zram")
    reclaim_idle_s: float = env(120.0, "DSEC_RECLAIM_IDLE_S", "a sandbox idle this long has its memory "
                                "reclaimed (0: never)")
    reclaim_pressed_idle_s: float = env(15.0, "DSEC_RECLAIM_PRESSED_IDLE_S", "the same under memory pressure")
    reclaim_psi: float = env(5.0, "DSEC_RECLAIM_PSI", "memory some avg10 (%) above which the node counts "
                             "as pressed")
    reclaim_per_tick: int = env(4, "DSEC_RECLAIM_PER_TICK", "sandboxes reclaimed at a time")
    reclaim_mem_low_mb: int = env(2048, "DSEC_RECLAIM_MEM_LOW_MB", "MemAvailable below this: idle sandboxes "
                                  "are reclaimed (VMs doze) once idle DSEC_RECLAIM_SQUEEZE_IDLE_S, back to back "
                                  "(0: off)", ge=0)
    reclaim_squeeze_idle_s: float = env(2.0, "DSEC_RECLAIM_SQUEEZE_IDLE_S", "the idle threshold while memory "
                                        "is low (DSEC_RECLAIM_MEM_LOW_MB) or a create waits for memory", ge=0)
    reclaim_cpu_psi: float = env(50.0, "DSEC_RECLAIM_CPU_PSI", "PSI cpu some avg10 (%) at or above which idle "
                                 "VMs doze once idle DSEC_RECLAIM_SQUEEZE_IDLE_S, back to back: awake idle guests "
                                 "cost CPU under TCG (0: off)", ge=0, le=100)
    liveness_stall_psi: float = env(60.0, "DSEC_LIVENESS_STALL_PSI", "while PSI cpu some or memory some "
                                    "avg10 (%) is at or above this, a guest that misses its liveness pings "
                                    "is not failed as hung: the host is stalled, not the guest (100: off)",
                                    ge=0, le=100)
    liveness_stall_max_s: float = env(300.0, "DSEC_LIVENESS_STALL_MAX_S", "... but a guest silent this long "
                                      "is failed anyway", ge=0)
    admit_reclaim_wait_s: float = env(10.0, "DSEC_ADMIT_RECLAIM_WAIT_S", "a create short of memory "
                                      "(DSEC_MEM_RESERVE_MB) waits at most this long for idle reclaim to free "
                                      "some before it is refused (0: refused at once)", ge=0)
    usage_idle_s: float = env(60.0, "DSEC_USAGE_IDLE_S", "each running sandbox's usage is sampled this often "
                              "(0: only sandboxes whose usage was asked for)", ge=0)
    usage_watched_s: float = env(5.0, "DSEC_USAGE_WATCHED_S", "... and this often for a minute after its usage "
                                 "was asked for (sb.metrics, dsec sandbox top, E2B get_metrics)", ge=1)


class StorageSettings(Group):
    title = "Storage and disk quotas (backends/container/disk.py)"
    disk_quota: Literal["auto", "btrfs", "poll"] = env("auto", "DSEC_DISK_QUOTA", "writable-layer quotas: "
                                                       "btrfs subvolumes (auto falls back to polling)")
    disk_poll_s: float = env(10.0, "DSEC_DISK_POLL_S", "how often upper dirs are measured where quotas are "
                             "polled")
    home_reserve_mb: int = env(1024, "DSEC_HOME_RESERVE_MB", "free space DSEC_HOME's filesystem keeps: "
                               "admission refuses below it, the scratch grows only above twice it")
    scratch_reserve_mb: int = env(256, "DSEC_SCRATCH_RESERVE_MB", "free space the sandboxes' scratch "
                                  "filesystem keeps before admission refuses")
    scratch_gb: float | None = env(None, "DSEC_SCRATCH_GB", "largest size of the scratch filesystem "
                                   "(GiB); unset: as the host filesystem allows")
    scratch_initial_gb: float = env(4.0, "DSEC_SCRATCH_INITIAL_GB", "size the scratch filesystem is "
                                    "created with (GiB)")
    scratch_check_s: float = env(1.0, "DSEC_SCRATCH_CHECK_S", "how often the scratch filesystem is "
                                 "checked for growth")
    volumes_dir: str = env("", "DSEC_VOLUMES_DIR", "where volumes live; empty: in the scratch filesystem "
                           "(btrfs quota per volume). A cluster points every node at one shared POSIX path "
                           "that supports idmapped mounts (size then measured at each mount)")
    volumes_project_gb: float = env(100.0, "DSEC_VOLUMES_PROJECT_GB", "the sizes (size_mb) of one project's "
                                    "volumes together may not pass this (GiB): a create beyond it is refused",
                                    gt=0)


class ContainerSettings(Group):
    title = "Containers (backends/container)"
    userns: bool = env(True, "DSEC_USERNS", "a user namespace per sandbox, with its own host id range")
    park_to_disk: bool = env(True, "DSEC_PARK_TO_DISK", "suspend a quiescent container to its files "
                             "(else freeze it and swap its memory)")
    lxcfs: bool = env(True, "DSEC_LXCFS", "sandboxes read their own memory and CPUs in /proc/meminfo, "
                      "/proc/cpuinfo, ... (the node's lxcfs daemon, started by dsec)")
    cpuset: bool = env(True, "DSEC_CPUSET", "each sandbox runs on ceil(cpu_cores) of the host's CPUs, the "
                       "least loaded (nproc and os.cpu_count() say its size)")
    cpu_quota_floor_cores: float = env(0.1, "DSEC_CPU_QUOTA_FLOOR_CORES", "the CFS quota never goes below "
                                       "this many cores (0..64)", ge=0, le=64)
    idmap_first: int = env(1 << 28, "DSEC_IDMAP_FIRST", "first host id of the sandboxes' id ranges")
    idmap_slots: int = env(4096, "DSEC_IDMAP_SLOTS", "id ranges of 65536 ids each (sandboxes with a user "
                           "namespace at once)")
    idmap_registry: Path = env(Path("/run/dsec/idranges"), "DSEC_IDMAP_REGISTRY", "where the id ranges in "
                               "use are recorded (shared by the dsecs of a host)")
    cgroup_parent: str = env("/dsec", "DSEC_CGROUP_PARENT", "the cgroup every sandbox's cgroup is made under "
                             "(an operator may cap the node's sandboxes with a memory limit on it: an OOM "
                             "kill from there ends a sandbox as host_pressure)",
                             pattern=r"^(/[A-Za-z0-9_][A-Za-z0-9_.-]*)+$", max_length=200)


class NetworkSettings(Group):
    title = "Network (backends/container/network.py)"
    bridge: str = env("dsec0", "DSEC_NET_BRIDGE", "the sandboxes' bridge (at most 15 characters)",
                      max_length=15)
    subnet: str = env("10.88.0.0/16", "DSEC_NET_SUBNET", "the sandboxes' IPv4 subnet (/28 or larger)")
    dns_upstream: str = env("", "DSEC_NET_DNS_UPSTREAM", "the resolver the node's DNS forwarder asks, "
                            "IP or IP:PORT; unset: the first nameserver of the host's /etc/resolv.conf",
                            max_length=64)
    dns_port: int = env(10053, "DSEC_NET_DNS_PORT", "port of the node's DNS forwarder on the bridge's "
                        "gateway address (sandboxes' UDP/TCP 53 to any address is sent there)", ge=1, le=65535)
    proxy_port: int = env(10080, "DSEC_NET_PROXY_PORT", "port of the node's egress proxy on the gateway "
                          "(TCP 80/443 of sandboxes with domain rules is sent there)", ge=1, le=65535)
    upstream_ca_file: str = env("", "DSEC_NET_UPSTREAM_CA_FILE", "CA bundle the egress proxy verifies a "
                                "destination against before adding a secret (`dsec secret`); unset: the "
                                "host's default trust store", max_length=4096)
    # the node's package cache (issue 25.4, backends/container/pkgcache.py)
    pkgcache_port: int = env(10081, "DSEC_PKGCACHE_PORT", "port of the node's package cache on the gateway "
                             "address (sandboxes' PIP_INDEX_URL and npm_config_registry name it, and apt's proxy in "
                             "Debian-based images); 0: no cache",
                             ge=0, le=65535)
    pkgcache_max_bytes: int = env(10 * GiB, "DSEC_PKGCACHE_MAX_BYTES", "size bound of the package cache's "
                                  "files (least recently used go first; seeded files stay)", ge=0)
    pkgcache_pypi_url: str = env("https://pypi.org/simple/", "DSEC_PKGCACHE_PYPI_URL", "the PEP 503 index the "
                                 "cache asks (user:password@ for a private one: never shown to sandboxes)",
                                 max_length=2048, secret=True)
    pkgcache_npm_url: str = env("https://registry.npmjs.org/", "DSEC_PKGCACHE_NPM_URL", "the npm registry the "
                                "cache asks (user:password@ as above)", max_length=2048, secret=True)
    pkgcache_index_ttl_s: float = env(300.0, "DSEC_PKGCACHE_INDEX_TTL_S", "an index page is asked upstream "
                                      "again after this (and served from the cache while upstream fails)", ge=0)


class ImageSettings(Group):
    title = "Images and the layer store (images/)"
    layer_store: str = env("", "DSEC_LAYER_STORE", "the layer store shared by all nodes: s3://BUCKET/PREFIX "
                           "or file:///PATH; unset: none")
    layer_store_timeout_s: float = env(10.0, "DSEC_LAYER_STORE_TIMEOUT_S", "timeout of one layer store request")
    lazy: bool | None = env(None, "DSEC_LAZY", "mount layers through the lazy FUSE view; unset: on with a "
                            "layer store")
    lazy_cache_bytes: int = env(8 * GiB, "DSEC_LAZY_CACHE_BYTES", "the lazy view's chunk cache")
    lazy_latency_ms: float = env(0.0, "DSEC_LAZY_LATENCY_MS", "latency added to each store read (benchmarks)")
    lazy_timeout_s: float = env(30.0, "DSEC_LAZY_TIMEOUT_S", "the lazy view gives up on a store read after this")
    lazy_bandwidth_mbps: float = env(0.0, "DSEC_LAZY_BANDWIDTH_MBPS", "store bandwidth cap in MB/s "
                                     "(benchmarks; 0: none)")
    lazy_prefetch: bool = env(True, "DSEC_LAZY_PREFETCH", "fetch a layer's recorded access profile in bulk "
                              "on first open")
    lazyfs_trace: bool = env(False, "DSEC_LAZYFS_TRACE", "log every read of the lazy view's daemon")
    heavy_parallel: int = env(0, "DSEC_HEAVY_PARALLEL", "threads for heavy image work (pack_diff, builds); "
                              "0: half the cores, at least 2")
    debian_mirror: str = env("http://deb.debian.org/debian", "DSEC_DEBIAN_MIRROR", "Debian mirror of the "
                             "built-in images' debootstrap")


class VMSettings(Group):
    title = "VMs (backends/vm)"
    enabled: bool = env(True, "DSEC_VM", "offer the QEMU backends (microvm, vm) where QEMU and a guest "
                        "kernel are present")
    boot_timeout_s: float = env(90.0, "DSEC_VM_BOOT_TIMEOUT_S", "a guest's agent must answer within this")
    ping_s: float = env(15.0, "DSEC_VM_PING_S", "liveness check interval of idle VMs' guests")
    console_max_bytes: int = env(1 << 20, "DSEC_VM_CONSOLE_MAX_BYTES", "a VM's console.log never exceeds "
                                 "this (at least 64 KiB)", ge=64 << 10)
    reclaim: Literal["auto", "1", "0"] = env("auto", "DSEC_VM_RECLAIM", "balloon squeezes of idle guests: "
                                             "auto under KVM only, 1 always, 0 never")
    reclaim_squeeze_s: float = env(15.0, "DSEC_VM_RECLAIM_SQUEEZE_S", "longest balloon squeeze")
    template_ram: Literal["disk", "tmpfs"] = env("disk", "DSEC_VM_TEMPLATE_RAM", "where template snapshots' "
                                                 "guest RAM files live: disk (DSEC_HOME/vm/template-ram: page "
                                                 "cache, dropped and read back under pressure, never swapped) or "
                                                 "tmpfs (/dev/shm: swapped to zram under pressure; D95)")
    templates_max: int = env(16, "DSEC_VM_TEMPLATES_MAX", "template snapshots kept (least recently used "
                             "go)", ge=1)
    tcg_tb_size_mb: int = env(32, "DSEC_VM_TCG_TB_SIZE_MB", "TCG translation cache in MiB of VMs started from "
                              "saved state (clones, resumes; `-accel tcg,tb-size=`; 0: QEMU's default of 1 GiB); "
                              "cold boots keep the default; no effect under KVM", ge=0)
    idle_stop: bool = env(True, "DSEC_VM_IDLE_STOP", "a VM without a NIC idle for DSEC_RECLAIM_IDLE_S "
                          "whose QEMU uses no CPU has its vCPUs stopped until its next request (QMP "
                          "stop/cont; the guest clock is set again on wake)")
    idle_pageout: bool = env(True, "DSEC_VM_IDLE_PAGEOUT", "a VM whose vCPUs were stopped idle has its "
                             "QEMU's private memory pushed to swap (zram): MADV_PAGEOUT")
    ksm: Literal["all", "ram", "0"] = env("all", "DSEC_VM_KSM", "mark guest RAM mergeable (`-machine mem-merge=on`) so the host's KSM "
                    "(scripts/host-setup.sh turns it on) merges identical pages across VMs; 0 closes the "
                    "cross-VM timing side channel of merged pages (docs/security.md)")
    qemu_thp: bool = env(False, "DSEC_VM_QEMU_THP", "transparent huge pages for the QEMUs of VMs started from saved "
                         "state (clones, resumes); off: each 2 MiB page QEMU faults in costs ~15x a 4 KiB one on a "
                         "node that is itself a VM returning free memory to its host (D94)")
    restore_stub_kernel: bool = env(True, "DSEC_VM_RESTORE_STUB_KERNEL", "1: microVMs started from saved state "
                                    "(clones, resumes) get the guest kernel's setup header as -kernel and no -initrd: "
                                    "QEMU no longer reads ~12 MiB into fresh memory per clone (D96; on again since "
                                    "D100: the 800-clone collapse was the CPU of awake idle guests)")


class FnCallEnvSettings(Group):
    title = "FnCall (fncall/)"
    min_warm: int = env(1, "DSEC_FNCALL_MIN_WARM", "warm workers per pool while it is in use")
    max_warm: int | None = env(None, "DSEC_FNCALL_MAX_WARM", "most workers per pool; unset: twice the "
                               "cores, at least 2")
    max_calls: int = env(1000, "DSEC_FNCALL_MAX_CALLS", "calls before a worker's container is replaced")
    idle_s: float = env(30.0, "DSEC_FNCALL_IDLE_S", "a worker idle this long above the floor is retired")
    keep_pool_s: float = env(600.0, "DSEC_FNCALL_KEEP_POOL_S", "without calls this long, a pool's floor "
                             "drops to 0")
    pin_cpu: bool = env(True, "DSEC_FNCALL_PIN_CPU", "pin each container's processes to one CPU")


class ClusterEnvSettings(Group):
    title = "Cluster and control database (cluster/, store/, apiserver/index.py)"
    db_url: str | None = env(None, "DSEC_DB_URL", "the control database: postgresql://...; unset: SQLite "
                             "files in DSEC_HOME", secret=True)
    db_retry_s: float = env(30.0, "DSEC_DB_RETRY_S", "how long to ride out a PostgreSQL restart")
    db_pool: int = env(8, "DSEC_DB_POOL", "PostgreSQL connections per process at most", ge=1)
    db_request_wait_s: float = env(0.5, "DSEC_DB_REQUEST_WAIT_S", "how long an API request waits for an "
                                   "unreachable control database before 503 + Retry-After (then at once, "
                                   "until it answers again)", gt=0)
    auth_cache_s: float = env(5.0, "DSEC_AUTH_CACHE_S", "API keys, project trees and policies are read again "
                              "after this long (a key revoked elsewhere stops working within it)", ge=0, le=10)
    auth_stale_s: float = env(3600.0, "DSEC_AUTH_STALE_S", "while the control database is unreachable, keys "
                              "and policies read within this long keep working", ge=0)
    index_sync_s: float = env(15.0, "DSEC_INDEX_SYNC_S", "how often the sandbox index is synced with the edges")
    index_lost_s: float = env(300.0, "DSEC_INDEX_LOST_S", "a node gone from discovery this long has its "
                              "index rows ended")
    edge_netns: bool = env(False, "DSEC_EDGE_NETNS", "`dsec cluster up`: each edge in a network namespace "
                           "of its own")


class Settings(BaseModel):
    """All of them, by concern."""

    model_config = ConfigDict(frozen=True)
    home: HomeSettings = Field(default_factory=HomeSettings)
    client: ClientSettings = Field(default_factory=ClientSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    events: EventSettings = Field(default_factory=EventSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    edge: EdgeEnvSettings = Field(default_factory=EdgeEnvSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    containers: ContainerSettings = Field(default_factory=ContainerSettings)
    network: NetworkSettings = Field(default_factory=NetworkSettings)
    images: ImageSettings = Field(default_factory=ImageSettings)
    vm: VMSettings = Field(default_factory=VMSettings)
    fncall: FnCallEnvSettings = Field(default_factory=FnCallEnvSettings)
    cluster: ClusterEnvSettings = Field(default_factory=ClusterEnvSettings)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings of this process: read once, at a composition root."""
        environ = os.environ if environ is None else environ
        return cls(**{name: group_of(f.annotation).from_env(environ) for name, f in cls.model_fields.items()})

    @property
    def paths(self) -> Paths:
        return Paths(self.home.home)

    def with_home(self, home: Path | str) -> Settings:
        """The same settings for another DSEC_HOME (a cluster edge's own home)."""
        return self.model_copy(update={"home": HomeSettings(home=Path(home))})

    def groups(self) -> list[Group]:
        return [getattr(self, name) for name in type(self).model_fields]

    def rows(self) -> list[tuple[str, str, str]]:
        """(name, effective value, source: env | default) of every setting, secrets masked."""
        out = []
        for g in self.groups():
            for attr, f in type(g).model_fields.items():
                value = getattr(g, attr)
                shown = show_default(value) if value is not None else "(unset)"
                if is_secret(f) and value:
                    shown = mask(str(value))
                out.append((str(f.alias), shown, "env" if attr in g.model_fields_set else "default"))
        return out


def group_of(annotation: Any) -> type[Group]:
    assert isinstance(annotation, type) and issubclass(annotation, Group), annotation
    return annotation


def group_classes() -> list[type[Group]]:
    return [group_of(f.annotation) for f in Settings.model_fields.values()]


def names() -> set[str]:
    """Every variable the settings read."""
    return {str(f.alias) for g in group_classes() for f in g.model_fields.values()}


# DSEC_* names of the test suite and its helpers, not of dsec itself
TEST_NAMES = frozenset({"DSEC_TEST_CACHE", "DSEC_SCHEMA_RANDOM", "DSEC_HARBOR_PYTHON", "DSEC_VERL_PYTHON"})


def unknown_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """DSEC_* variables set that no setting reads (typos, or settings that were removed)."""
    environ = os.environ if environ is None else environ
    known = names() | TEST_NAMES
    return sorted(k for k in environ if k.startswith("DSEC_") and k not in known)


def is_secret(f: Any) -> bool:
    return bool(isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("secret"))


def mask(value: str) -> str:
    """A URL keeps all but its password; anything else is hidden whole."""
    parts = urlsplit(value)
    if parts.scheme and parts.netloc:
        if parts.password is None:
            return value
        return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))
    return "***"


def type_name(annotation: Any) -> str:
    """int, float, bool, str, path, `a | b` for literals; `x or unset` for optional ones."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " | ".join(type_name(a) for a in args) + " (or unset)"
    if annotation is Path:
        return "path"
    if annotation is bool:
        return "bool (1/0, true/false)"
    return getattr(annotation, "__name__", str(annotation))


def show_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if value == "":
        return '""'
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


__all__ = ["Settings", "Group", *[c.__name__ for c in group_classes()], "names"]
