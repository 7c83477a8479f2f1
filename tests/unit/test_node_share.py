"""Per-edge CPU/memory share (D39, edge/node_share.py) and tenancy checked against the chosen
node's registry when the apiserver has none (cluster replicas): no root, fake backends, a real
IAM (SQLite), real image registries, the real placer, watcher and control plane."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from dsec.apiserver import control
from dsec.apiserver.context import ApiContext
from dsec.cluster.ray_cluster import ClusterSettings, share_env
from dsec.config import Paths
from dsec.edge.admission import Admission
from dsec.edge.edge import Edge, EdgeSettings
from dsec.edge.node_share import CgroupLimits, cgroup_limits, node_share
from dsec.edge.pressure import HostProbe
from dsec.iam import IAM, Principal
from dsec.images.service import ImageService
from dsec.placement import Placer
from dsec.settings import AdmissionSettings, Settings
from dsec.testing.fake_backend import FakeBackend
from dsec.types import CapacityExceeded, ContainerArgs, InvalidArgument, LayerInfo, NotFound
from dsec.watcher import Watcher

from .test_admission import SETTINGS, FakeProc

SHARE_SETTINGS = ("DSEC_NODE_CPU_CORES", "DSEC_NODE_MEMORY_MB", "DSEC_NODE_SHARE")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in SETTINGS + SHARE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def two_core_8gib(tmp_path: Path) -> Admission:
    proc = FakeProc(Path(tempfile.mkdtemp(dir=tmp_path)) / "proc")
    return Admission.for_this_host(probe=HostProbe(proc.root), cores=2, conf=Settings.from_env())


# -- the share -------------------------------------------------------------------------------

def test_whole_host_by_default(env, tmp_path) -> None:
    adm = two_core_8gib(tmp_path)
    assert adm.capacity.cpu_cores == 4000 and adm.capacity.memory_mb == 8192 * 256
    assert adm.capacity.node_cpu_cores is None and adm.capacity.node_memory_mb is None


def test_explicit_caps_set_the_ceilings_and_refusals_name_them(env, tmp_path) -> None:
    env.setenv("DSEC_NODE_CPU_CORES", "0.5")
    env.setenv("DSEC_NODE_MEMORY_MB", "1024")
    env.setenv("DSEC_CPU_OVERCOMMIT", "4")
    env.setenv("DSEC_MEM_OVERCOMMIT", "2")
    adm = two_core_8gib(tmp_path)
    c = adm.capacity
    assert (c.cpu_cores, c.memory_mb, c.node_cpu_cores, c.node_memory_mb) == (2.0, 2048, 0.5, 1024)
    from .test_admission import status
    with pytest.raises(CapacityExceeded) as e:
        adm.admit(status(1, cpu=1.5), 1.0, 64)
    assert e.value.field == "cpu_cores"
    assert "ceiling 2 cores (DSEC_NODE_CPU_CORES=0.5 x DSEC_CPU_OVERCOMMIT)" in e.value.message
    assert "DSEC_NODE_CPU_CORES" in (e.value.fix or "")
    with pytest.raises(CapacityExceeded) as e:
        adm.admit(status(1, mem=2000), 0.1, 64)
    assert e.value.field == "memory_mb" and "DSEC_NODE_MEMORY_MB=1024 x DSEC_MEM_OVERCOMMIT" in e.value.message


def test_a_fraction_of_the_host(env, tmp_path) -> None:
    env.setenv("DSEC_NODE_SHARE", "1/4")
    adm = two_core_8gib(tmp_path)
    assert adm.capacity.node_cpu_cores == 0.5 and adm.capacity.node_memory_mb == 2048
    assert adm.capacity.cpu_cores == 1000 and "1/4 of cores (DSEC_NODE_SHARE)" in adm.cpu_basis
    env.setenv("DSEC_NODE_CPU_CORES", "1.5")      # an explicit amount replaces the fraction for its resource
    adm = two_core_8gib(tmp_path)
    assert adm.capacity.node_cpu_cores == 1.5 and adm.capacity.node_memory_mb == 2048


@pytest.mark.parametrize("name,value,says", [
    ("DSEC_NODE_CPU_CORES", "lots", "not a positive number of CPU cores"),
    ("DSEC_NODE_CPU_CORES", "0", "not a positive number of CPU cores"),
    ("DSEC_NODE_CPU_CORES", "3", "more than this edge has: 2 CPU cores (cores)"),
    ("DSEC_NODE_MEMORY_MB", "512.5", "not a positive whole number of MiB"),
    ("DSEC_NODE_MEMORY_MB", "-1", "not a positive whole number of MiB"),
    ("DSEC_NODE_MEMORY_MB", "99999", "more than this edge has: 8192 MiB (MemTotal)"),
    ("DSEC_NODE_SHARE", "3/2", "not a fraction of the host in (0, 1]"),
    ("DSEC_NODE_SHARE", "1/0", "not a fraction of the host in (0, 1]"),
    ("DSEC_NODE_SHARE", "half", "not a fraction of the host in (0, 1]"),
])
def test_bad_values_are_refused_naming_the_variable_and_fix(env, tmp_path, name, value, says) -> None:
    env.setenv(name, value)
    with pytest.raises(InvalidArgument) as e:
        two_core_8gib(tmp_path)
    assert e.value.field == name and says in e.value.message and name in e.value.message
    assert name in (e.value.fix or "")


def _cgroup_tree(tmp_path: Path, self_cgroup: str) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(self_cgroup)
    root.mkdir()
    return proc, root


def test_cgroup_v2_limits_of_the_edge_and_its_ancestors_bound_the_share(tmp_path) -> None:
    proc, root = _cgroup_tree(tmp_path, "0::/ray/edge1\n")
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "ray" / "edge1").mkdir(parents=True)
    (root / "ray" / "cpu.max").write_text("50000 100000\n")          # the parent: half a core
    (root / "ray" / "edge1" / "cpu.max").write_text("max 100000\n")
    (root / "ray" / "edge1" / "memory.max").write_text(f"{1 << 30}\n")
    (root / "ray" / "memory.max").write_text("max\n")
    limits = cgroup_limits(proc, root)
    assert (limits.cpu_cores, limits.memory_mb, limits.where) == (0.5, 1024, "/ray/edge1")
    share = node_share(AdmissionSettings(), 2, 8192, limits)
    assert (share.cpu_cores, share.memory_mb, share.explicit) == (0.5, 1024, True)
    assert share.cpu_basis == "cpu.max of cgroup /ray/edge1"
    with pytest.raises(InvalidArgument) as e:            # an explicit amount cannot exceed the cgroup
        node_share(AdmissionSettings.from_env({"DSEC_NODE_CPU_CORES": "1"}), 2, 8192, limits)
    assert "0.5 CPU cores (cpu.max of cgroup /ray/edge1)" in e.value.message
    assert node_share(AdmissionSettings.from_env({"DSEC_NODE_SHARE": "1/2"}), 2, 8192, limits).cpu_cores == 0.25


def test_cgroup_v1_limits(tmp_path) -> None:
    proc, root = _cgroup_tree(tmp_path, "4:memory:/svc\n1:cpu,cpuacct:/svc\n0::/\n")
    (root / "memory" / "svc").mkdir(parents=True)
    (root / "memory" / "svc" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # v1's "no limit"
    (root / "cpu,cpuacct" / "svc").mkdir(parents=True)
    (root / "cpu,cpuacct" / "svc" / "cpu.cfs_quota_us").write_text("150000\n")
    (root / "cpu,cpuacct" / "svc" / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_limits(proc, root) == CgroupLimits(1.5, 2048, "/svc")
    assert node_share(AdmissionSettings(), 4, 8192, CgroupLimits()) .explicit is False


def test_cluster_up_splits_a_shared_host_between_its_edges() -> None:
    nodes = [{"NodeID": "a", "NodeManagerHostname": "box1"}, {"NodeID": "b", "NodeManagerHostname": "box1"},
             {"NodeID": "c", "NodeManagerHostname": "box1"}, {"NodeID": "d", "NodeManagerHostname": "box2"}]
    env = share_env(ClusterSettings(), nodes)
    assert env == {"a": {"DSEC_NODE_SHARE": "1/3"}, "b": {"DSEC_NODE_SHARE": "1/3"},
                   "c": {"DSEC_NODE_SHARE": "1/3"}, "d": {}}
    env = share_env(ClusterSettings(share_hosts=False, node_cpu_cores=4, node_memory_mb=8192), nodes)
    assert env["a"] == env["d"] == {"DSEC_NODE_CPU_CORES": "4", "DSEC_NODE_MEMORY_MB": "8192"}


# -- two edges behind one control plane ------------------------------------------------------

def _put(images: ImageService, name: str, owner: str | None) -> None:
    layer = LayerInfo(digest="sha256:" + ("%064x" % abs(hash(name))), size_bytes=1,
                      created_at=datetime.now(timezone.utc), source="test")
    with images.registry.transaction() as db:
        images.registry.put_image(db, name, [layer], replace=False, owner=owner)


class Two:
    def __init__(self, ctx: ApiContext, iam: IAM, edges: dict[str, Edge], images: dict[str, ImageService]):
        self.ctx, self.iam, self.edges, self.images = ctx, iam, edges, images

    def who(self, project_id: str) -> Principal:
        return self.iam.authenticate(self.iam.create_key(project_id))


@pytest.fixture
async def two(env, tmp_path: Path, short_tmp: Path) -> AsyncIterator[Two]:
    """n1 capped at 0.001 core (a ceiling of 2 cores at the default overcommit), n2 the whole
    host; no registry in the apiserver (ctx.images None), as in a cluster replica."""
    iam = IAM(tmp_path / "iam.db")
    iam.bootstrap(tmp_path / "admin.key")
    edges, images, backends = {}, {}, []
    for node in ("n1", "n2"):
        paths = Paths(short_tmp / node)
        paths.ensure()
        images[node] = ImageService(paths)
        _put(images[node], "busybox", None)
        backends.append(FakeBackend(short_tmp / f"rt-{node}"))
        if node == "n1":
            env.setenv("DSEC_NODE_CPU_CORES", "0.001")
        adm = Admission.for_this_host(probe=HostProbe(FakeProc(tmp_path / f"proc-{node}").root), cores=2,
                                      conf=Settings.from_env())
        env.delenv("DSEC_NODE_CPU_CORES", raising=False)
        adm.mem_reserve_mb = 0
        edges[node] = Edge(paths, images[node], [backends[-1]], EdgeSettings(node_id=node, reap_interval_s=3600),
                           adm)
        await edges[node].start()
    watcher = Watcher(edges, interval_s=1.0)
    await watcher.poll_once()
    ctx = ApiContext(iam=iam, edges=edges, watcher=watcher, placer=Placer(k=2), images=None)
    try:
        yield Two(ctx, iam, edges, images)
    finally:
        for e in edges.values():
            for sb in await e.list():
                await e.stop(sb.id)
            await e.close()
        for b in backends:
            await b.close()
        iam.close()


async def test_a_capped_node_refuses_naming_its_cap_and_placement_uses_the_other(two: Two) -> None:
    n1 = next(n for n in two.ctx.watcher.nodes() if n.node_id == "n1")
    assert n1.capacity.node_cpu_cores == 0.001 and n1.capacity.cpu_cores == 2
    big = ContainerArgs(image="busybox", cpu_cores=3, memory_mb=64)
    with pytest.raises(CapacityExceeded) as e:
        await two.edges["n1"].create("p", big)
    assert "DSEC_NODE_CPU_CORES=0.001 x DSEC_CPU_OVERCOMMIT" in e.value.message and e.value.field == "cpu_cores"
    root = two.who(two.iam.root().id)
    for _ in range(4):      # power-of-two choices would pick n1 about half the time were it not capped
        info = await control.create_sandbox(two.ctx, root, big)
        assert info.id.startswith("sb-n2."), info.id


async def test_without_a_registry_of_its_own_the_apiserver_checks_owners_on_the_chosen_node(two: Two) -> None:
    a = two.iam.create_project("a", two.iam.root().id)
    a_child = two.iam.create_project("a-child", a.id)
    b = two.iam.create_project("b", two.iam.root().id)
    for images in two.images.values():
        _put(images, "ws-a@1", a.id)
    for who, ok in ((two.who(b.id), False), (two.who(a.id), True), (two.who(a_child.id), True),
                    (two.who(two.iam.root().id), True)):
        for fld, args in (("workspace", ContainerArgs(image="busybox", workspace="ws-a@1", memory_mb=64)),
                          ("image", ContainerArgs(image="ws-a@1", memory_mb=64)),
                          ("toolkits[0]", ContainerArgs(image="busybox", toolkits=["ws-a@1"], memory_mb=64))):
            if ok:
                await control.create_sandbox(two.ctx, who, args)
                continue
            with pytest.raises(NotFound) as e:
                await control.create_sandbox(two.ctx, who, args)
            assert e.value.field == fld
            assert e.value.message == f"no {fld.split('[')[0].rstrip('s')} 'ws-a@1' for this project ({fld})"
    with pytest.raises(NotFound) as e:          # missing on the node: the node's own answer, naming the field
        await control.create_sandbox(two.ctx, two.who(a.id), ContainerArgs(image="busybox", workspace="nope@1"))
    assert e.value.field == "workspace" and "on this node" in e.value.message


async def test_two_edges_in_one_process_share_one_metrics_registry(two: Two) -> None:
    """Both nodes' gauges in the process's exposition (one collector for every edge: a registry
    refuses two that yield the same names), and a refusal counted by what was short."""
    from dsec import metrics
    before = metrics.REFUSED.labels("cpu")._value.get()
    with pytest.raises(CapacityExceeded):
        await two.edges["n1"].create("p", ContainerArgs(image="busybox", cpu_cores=3, memory_mb=64))
    assert metrics.REFUSED.labels("cpu")._value.get() == before + 1
    text = await two.edges["n2"].metrics_text()
    for node in ("n1", "n2"):
        assert f'dsec_node_capacity_sandboxes{{node="{node}"}}' in text
    assert 'dsec_sandbox_creates_total{backend="container",outcome="refused",project="p"}' in text \
        or 'dsec_sandbox_creates_total{project="p",backend="container",outcome="refused"}' in text
