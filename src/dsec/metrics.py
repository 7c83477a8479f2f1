"""dsec's Prometheus metrics: every name and label in one place (docs/metrics.md lists them).

One registry per process (prometheus_client's default): the embedded deployment's apiserver
and edge share it, so its one `/metrics` has both; in a cluster each edge process serves its
own (`GET /v1/nodes/{node}/metrics` on the apiserver fetches it: apiserver/metrics_routes.py).

Cardinality is bounded: no label names a sandbox, an exec or an image. `project` is bounded
by the projects an admin made; every other label takes values from a fixed vocabulary
(below), so a new reason (issue 26 item 3's end reasons) is one more value, not a new name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dsec.types import CapacityExceeded, DsecError, SandboxState

# an edge (dsec.edge.core.EdgeCore), read duck-typed: the edge imports this module, not the reverse
EdgeCore = Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# create stages, in order: what each histogram bucket series times
STAGES = ("prepare", "admission", "start", "agent", "total")
CREATE_OUTCOMES = ("ok", "refused", "failed")
# admission refusals: what was short (a fixed vocabulary; "quota" is the apiserver's)
REFUSALS = ("max_sandboxes", "memory", "cpu", "pressure", "storage", "quota", "other")
EXEC_KINDS = ("run", "stream", "start")

CREATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
EXEC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
SAMPLE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01, 0.05)

CREATES = Counter("dsec_sandbox_creates", "sandbox creations by outcome (ok, refused, failed)",
                  ["project", "backend", "outcome"])
CREATE_SECONDS = Histogram("dsec_sandbox_create_seconds", "seconds of each stage of a sandbox creation on its "
                           "node (prepare: validation and image; admission; slot: waiting for a start slot; "
                           "start: the runtime; agent: until the agent answers; total)", ["backend", "stage"], buckets=CREATE_BUCKETS)
REFUSED = Counter("dsec_admission_refusals", "creations refused for want of something, by what",
                  ["reason"])
EXECS = Counter("dsec_execs", "commands started, by how (run: wait for the result; stream; start: detached)",
                ["project", "backend", "kind"])
EXEC_SECONDS = Histogram("dsec_exec_seconds", "seconds from a run's request to its result (the command's own "
                         "time included)", ["backend"], buckets=EXEC_BUCKETS)
ENDS = Counter("dsec_sandbox_ends", "sandboxes ended on the node, by end reason (docs/events.md: node_lost, "
               "oom_killed, ... killed, ttl, lifetime) and whether the infrastructure ended them",
               ["project", "backend", "reason", "infrastructure"])
PLACEMENTS = Counter("dsec_placements", "placement decisions of the apiserver: placed, retried elsewhere "
                     "(a node refused or was unreachable), none left, or refused before placement "
                     "(rate_limited, queue_full: apiserver/fair_creates.py)", ["outcome"])
USAGE_SAMPLES = Counter("dsec_usage_samples", "per-sandbox usage samples taken (edge/usage.py)", ["backend"])
USAGE_SAMPLE_SECONDS = Histogram("dsec_usage_sample_seconds", "seconds one sandbox's usage sample takes",
                                 buckets=SAMPLE_BUCKETS)

_RECORDED = ("CREATES", "CREATE_SECONDS", "REFUSED", "EXECS", "EXEC_SECONDS", "ENDS", "PLACEMENTS",
             "USAGE_SAMPLES", "USAGE_SAMPLE_SECONDS")
_REAL: dict[str, Any] = {name: globals()[name] for name in _RECORDED}
OFF_TEXT = "# dsec metrics are off on this server (DSEC_OBSERVABILITY=0): unset it to record them\n"


class _Off:
    """A metric that records nothing: what every name above is while metrics are off."""

    def labels(self, *_: Any, **__: Any) -> "_Off":
        return self

    def inc(self, *_: Any) -> None:
        pass

    def observe(self, *_: Any) -> None:
        pass


_OFF = _Off()
_on = True


def set_enabled(on: bool) -> None:
    """Record (the default) or not (DSEC_OBSERVABILITY=0), for the whole process: callers read
    `metrics.NAME` at each use, so swapping the module's names reaches them all; nothing is
    checked on the hot path."""
    global _on
    _on = on
    for name, real in _REAL.items():
        globals()[name] = real if on else _OFF
    if not on:
        EDGES.edges.clear()      # no gauges computed at scrape time either


def enabled() -> bool:
    return _on


def refusal_reason(e: DsecError) -> str:
    """What an admission refusal was short of (edge/admission.py's errors), one of REFUSALS."""
    name, msg = type(e).__name__, str(e)
    if name == "StorageLow":
        return "storage"
    if name == "PressureHigh":
        return "pressure"
    if isinstance(e, CapacityExceeded):
        for key, reason in (("sandboxes", "max_sandboxes"), ("memory limits", "memory"), ("cpu limits", "cpu")):
            if key in msg:
                return reason
    return "other"


class EdgeCollector(Collector):
    """The gauges of every edge in this process (a cluster test may run several), read from
    their running totals at scrape time (O(sandboxes) for the by-state count, no I/O but the
    PSI files the admission already reads). One collector: a registry refuses two that
    yield the same names."""

    def __init__(self) -> None:
        self.edges: dict[int, "EdgeCore"] = {}

    def collect(self) -> Iterator[Metric]:
        fams: dict[str, GaugeMetricFamily] = {}

        def fam(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            if name not in fams:
                fams[name] = GaugeMetricFamily(name, doc, labels=labels)
            return fams[name]

        for e in list(self.edges.values()):
            self._edge(e, fam)
        yield from fams.values()

    @staticmethod
    def _edge(e: "EdgeCore", fam: "Callable[[str, str, list[str]], GaugeMetricFamily]") -> None:
        node = e.node_id
        by = fam("dsec_sandboxes", "sandboxes on the node by state, backend and project; parked ones "
                 "(state suspended) by where their memory is: memory or disk",
                 ["node", "state", "backend", "project", "parked"])
        counts: dict[tuple[str, str, str, str], int] = {}
        for live in list(e._live.values()):
            r = live.rec
            parked = live.parked_where if r.state == SandboxState.suspended else ""
            k = (r.state.value, r.backend, r.project, parked)
            counts[k] = counts.get(k, 0) + 1
        for (state, backend, project, parked), n in counts.items():
            by.add_metric([node, state, backend, project, parked], n)
        one = ["node"]
        fam("dsec_node_committed_cpu_cores", "CPU limits of the live sandboxes", one).add_metric([node], e._load.cpu_cores)
        fam("dsec_node_committed_memory_mb", "memory limits of the live sandboxes (MiB)", one).add_metric(
            [node], e._load.memory_mb)
        fam("dsec_node_capacity_sandboxes", "sandboxes the node admits at most", one).add_metric(
            [node], e.admission.capacity.max_sandboxes)
        psi = fam("dsec_node_pressure_avg10", "the host's PSI avg10 (percent of time stalled) per resource "
                  "(cpu, memory, io) and kind (some, full)", ["node", "resource", "kind"])
        try:
            reading = e.admission.probe.read()
            for key, value in sorted(reading.psi.items()):
                resource, _, kind = key.partition(" ")
                psi.add_metric([node, resource, kind], value)
            if reading.mem_available_mb is not None:
                fam("dsec_node_memory_available_mb", "MemAvailable of the host (MiB)", one).add_metric(
                    [node], reading.mem_available_mb)
        except OSError:
            pass
        pools = e._pools.status()
        idle = fam("dsec_warm_pool_idle", "idle warm-pool sandboxes waiting per image, and the pool's target size; "
                   "pool: the operator's (configured) or the node's own (auto, D99)", ["node", "image", "of", "pool"])
        for source, items in (("configured", pools["pools"]), ("auto", pools["auto"])):
            for image, p in items.items():     # type: ignore[union-attr]
                idle.add_metric([node, image, "idle", source], p["idle"])
                idle.add_metric([node, image, "target", source], p["size"])
        claims = fam("dsec_warm_pool_lookups", "creates that matched a warm pool: claimed one (hit) or found it "
                     "empty (miss), since the edge started", ["node", "result"])
        claims.add_metric([node, "hit"], float(pools["claims"]))    # type: ignore[arg-type]
        claims.add_metric([node, "miss"], float(pools["misses"]))   # type: ignore[arg-type]
        fam("dsec_usage_watched_sandboxes", "sandboxes sampled every 5 s (asked for in the last 60 s)", one).add_metric(
            [node], e._usage.watched_count())


EDGES = EdgeCollector()
REGISTRY.register(EDGES)


def add_edge(edge: "EdgeCore") -> None:
    if _on:
        EDGES.edges[id(edge)] = edge


def remove_edge(edge: "EdgeCore") -> None:
    EDGES.edges.pop(id(edge), None)


class _OneProject(Collector):
    """The process's metrics, only the samples labelled with one project."""

    def __init__(self, project: str):
        self.project = project

    def collect(self) -> Iterable[Metric]:
        for fam in REGISTRY.collect():
            kept = [s for s in fam.samples if s.labels.get("project") == self.project]
            if kept:
                out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples = kept
                yield out


def exposition(project: str | None = None) -> str:
    """The process's metrics in Prometheus' text format; with `project`, only that project's
    series (what a project key may see)."""
    if not _on:
        return OFF_TEXT
    if project is None:
        return generate_latest(REGISTRY).decode()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_OneProject(project))
    return generate_latest(reg).decode()
