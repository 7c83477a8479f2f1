"""Admission by measured use and pressure (no root): fake /proc trees for PSI and meminfo."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dsec.edge.admission import Admission, PressureHigh, psi_limits
from dsec.settings import AdmissionSettings, Settings
from dsec.edge.pressure import HostProbe, parse_psi
from dsec.types import CapacityExceeded, MicroVMArgs, NodeCapacity, NodeStatus, SandboxState

from ._helpers import Node

GiB_KB = 1 << 20
CALM = {"cpu": (1.0, 0.0), "memory": (0.5, 0.1), "io": (2.0, 0.3)}   # (some, full) avg10
SETTINGS = ("DSEC_CPU_OVERCOMMIT", "DSEC_MEM_OVERCOMMIT", "DSEC_MAX_SANDBOXES", "DSEC_MEM_RESERVE_MB",
            "DSEC_ADMIT_SANDBOX_MB", "DSEC_ADMIT_PSI_CPU_SOME", "DSEC_ADMIT_PSI_MEMORY_SOME",
            "DSEC_ADMIT_PSI_MEMORY_FULL", "DSEC_ADMIT_PSI_IO_FULL")


class FakeProc:
    """A /proc with meminfo and pressure/{cpu,memory,io} written by the test."""

    def __init__(self, root: Path, total_gib: int = 8, available_mb: int = 6000, psi: bool = True):
        self.root = root
        (root / "pressure").mkdir(parents=True)
        self.meminfo(total_gib, available_mb)
        if psi:
            for resource, (some, full) in CALM.items():
                self.psi(resource, some=some, full=full)

    def meminfo(self, total_gib: int, available_mb: int) -> None:
        (self.root / "meminfo").write_text(f"MemTotal:       {total_gib * GiB_KB} kB\n"
                                           f"MemFree:        {available_mb * 512} kB\n"
                                           f"MemAvailable:   {available_mb * 1024} kB\n")

    def psi(self, resource: str, some: float = 0.0, full: float = 0.0) -> None:
        (self.root / "pressure" / resource).write_text(
            f"some avg10={some:.2f} avg60=0.00 avg300=0.00 total=123\n"
            f"full avg10={full:.2f} avg60=0.00 avg300=0.00 total=45\n")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No admission setting of the developer's shell leaks into the defaults under test."""
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


@pytest.fixture
def clock() -> Clock:
    return Clock()


def two_core_node(proc: FakeProc, clock: Clock) -> Admission:
    """The defaults on a 2-core, 8-GiB node (this host's own size does not matter)."""
    return Admission.for_this_host(probe=HostProbe(proc.root, clock=clock), cores=2, conf=Settings.from_env())


def status(n: int = 0, cpu: float = 0.0, mem: int = 0) -> NodeStatus:
    return NodeStatus(node_id="n1", healthy=True, backends=["container"],
                      capacity=NodeCapacity(cpu_cores=1, memory_mb=1, max_sandboxes=1),
                      committed_cpu_cores=cpu, committed_memory_mb=mem, sandboxes=n)


def test_parse_psi_reads_avg10_of_each_line() -> None:
    assert parse_psi("some avg10=12.50 avg60=1.00 avg300=0.00 total=9\n"
                     "full avg10=0.25 avg60=0.00 avg300=0.00 total=1\n") == {"some": 12.5, "full": 0.25}


def test_3200_default_sandboxes_fit_the_default_ceilings_of_a_2_core_8_gib_node(env, proc, clock) -> None:
    adm = two_core_node(proc, clock)
    assert adm.capacity.cpu_cores == 4000 and adm.capacity.memory_mb == 8192 * 256
    for n in range(3200):   # 1 core, 512 MiB each: the sum of limits is 1,600x the cores
        adm.admit(status(n, cpu=n * 1.0, mem=n * 512), 1.0, 512)


def test_the_ceilings_still_refuse_beyond_their_ratio(env, proc, clock) -> None:
    env.setenv("DSEC_CPU_OVERCOMMIT", "16")     # the old ratio: 32 one-core sandboxes on 2 cores
    adm = two_core_node(proc, clock)
    adm.admit(status(31, cpu=31.0, mem=31 * 512), 1.0, 512)
    with pytest.raises(CapacityExceeded) as e:
        adm.admit(status(32, cpu=32.0, mem=32 * 512), 1.0, 512)
    assert e.value.field == "cpu_cores" and "DSEC_CPU_OVERCOMMIT" in e.value.message
    assert "32+1 > ceiling 32 cores" in e.value.message and "DSEC_CPU_OVERCOMMIT" in (e.value.fix or "")
    # memory at the default ratio: 256 x 8 GiB of limits, asked for 64 GiB at a time
    adm = two_core_node(proc, clock)
    with pytest.raises(CapacityExceeded) as e:
        adm.admit(status(32, cpu=32.0, mem=32 * 65536), 1.0, 65536)
    assert e.value.field == "memory_mb" and "DSEC_MEM_OVERCOMMIT" in e.value.message
    assert not isinstance(e.value, PressureHigh)   # a promise too big: no point retrying soon
    with pytest.raises(CapacityExceeded) as e:
        adm.admit(status(4000), 0.1, 16)
    assert "4000/4000 sandboxes" in e.value.message and "DSEC_MAX_SANDBOXES" in e.value.message


@pytest.mark.parametrize("resource,kind,value,setting,field", [
    ("cpu", "some", 93.5, "DSEC_ADMIT_PSI_CPU_SOME", "cpu_cores"),
    ("memory", "some", 25.0, "DSEC_ADMIT_PSI_MEMORY_SOME", "memory_mb"),
    ("memory", "full", 12.0, "DSEC_ADMIT_PSI_MEMORY_FULL", "memory_mb"),
    ("io", "full", 40.0, "DSEC_ADMIT_PSI_IO_FULL", None),
])
def test_pressure_refuses_naming_the_resource_value_limit_and_setting(
        env, proc, clock, resource: str, kind: str, value: float, setting: str, field: str | None) -> None:
    some, full = CALM[resource]
    if setting == "DSEC_ADMIT_PSI_CPU_SOME":
        env.setenv(setting, "90")              # off by default (throttled tiny quotas read as pressure)
    proc.psi(resource, some=value if kind == "some" else some, full=value if kind == "full" else full)
    adm = two_core_node(proc, clock)
    with pytest.raises(PressureHigh) as e:
        adm.admit(status(), 1.0, 512)
    err = e.value
    assert isinstance(err, CapacityExceeded) and err.status == 429   # placement moves on
    assert f"PSI {resource} {kind} avg10 {value:g}%" in err.message and setting in err.message
    assert err.field == field and setting in (err.fix or "") and err.retry_after_s > 0
    assert adm.pressure() > 1
    env.setenv(setting, "100")                 # 100 turns the check off
    two_core_node(proc, clock).admit(status(), 1.0, 512)


def test_pressure_limits_are_set_by_their_variables(env) -> None:
    env.setenv("DSEC_ADMIT_PSI_MEMORY_FULL", "2.5")
    limits = {(p.resource, p.kind): p.limit for p in psi_limits(AdmissionSettings.from_env())}
    assert limits == {("cpu", "some"): 100, ("memory", "some"): 20, ("memory", "full"): 2.5, ("io", "full"): 20}


def test_memavailable_must_cover_the_reserve_and_a_new_sandboxs_need(env, proc, clock) -> None:
    proc.meminfo(8, available_mb=512 + 8)      # reserve 512 + 8 MiB for the new one: just enough
    adm = two_core_node(proc, clock)
    adm.admit(status(), 1.0, 4096)             # its limit (4 GiB) is not what it needs at first
    proc.meminfo(8, available_mb=515)
    clock.t += 1
    with pytest.raises(PressureHigh) as e:
        adm.admit(status(), 1.0, 512)
    assert e.value.field == "memory_mb" and "MemAvailable 515 MiB" in e.value.message
    assert "DSEC_MEM_RESERVE_MB" in e.value.message and "DSEC_ADMIT_SANDBOX_MB" in e.value.message
    assert adm.host_problem() is None          # above the reserve: the node stays healthy
    proc.meminfo(8, available_mb=100)
    clock.t += 1
    assert "DSEC_MEM_RESERVE_MB" in (adm.host_problem() or "")


def test_readings_are_cached_for_a_second(env, proc, clock, monkeypatch: pytest.MonkeyPatch) -> None:
    adm = two_core_node(proc, clock)
    reads = []
    real = HostProbe._read_now
    monkeypatch.setattr(HostProbe, "_read_now", lambda self: reads.append(1) or real(self))
    for _ in range(100):                       # a burst of creates reads /proc once
        adm.admit(status(), 1.0, 512)
        adm.pressure()
    assert len(reads) <= 1
    proc.psi("memory", some=50.0)
    clock.t += 0.5
    adm.admit(status(), 1.0, 512)              # still the cached reading
    clock.t += 0.5
    with pytest.raises(PressureHigh):
        adm.admit(status(), 1.0, 512)


def test_missing_psi_skips_those_checks_and_says_so_once(env, tmp_path, clock, caplog) -> None:
    proc = FakeProc(tmp_path / "proc", psi=False)
    proc.psi("memory", some=1.0)
    (proc.root / "pressure" / "io").mkdir()    # present but unreadable, like a kernel booted psi=0
    caplog.set_level(logging.WARNING, logger="dsec.edge")
    adm = two_core_node(proc, clock)
    for _ in range(3):
        adm.admit(status(), 1.0, 512)
        clock.t += 1
    said = [r.getMessage() for r in caplog.records]
    assert sum("pressure/cpu" in m for m in said) == 1 and sum("pressure/io" in m for m in said) == 1
    assert not any("pressure/memory" in m for m in said)
    proc.psi("memory", some=30.0)              # the check that remains still works
    with pytest.raises(PressureHigh, match="DSEC_ADMIT_PSI_MEMORY_SOME"):
        adm.admit(status(), 1.0, 512)


def test_admission_built_by_hand_checks_no_pressure(tmp_path, clock) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.psi("cpu", some=100.0)
    adm = Admission(NodeCapacity(cpu_cores=4, memory_mb=4096, max_sandboxes=10), mem_reserve_mb=0,
                    probe=HostProbe(proc.root, clock=clock))
    adm.admit(status(), 1.0, 512)
    assert adm.pressure() == 0.0


async def test_memory_pressure_refuses_create_and_resume_of_a_parked_sandbox(env, node: Node, proc, clock) -> None:
    edge = await node.start(admission=two_core_node(proc, clock))
    sb = (await edge.create("p", MicroVMArgs(image="busybox"))).id
    assert (await edge.status()).pressure < 1
    await edge.suspend(sb)
    proc.psi("memory", some=5.0, full=30.0)
    clock.t += 1
    assert (await edge.status()).pressure == 3.0   # the watcher sees it: placement prefers others
    with pytest.raises(PressureHigh, match="DSEC_ADMIT_PSI_MEMORY_FULL"):
        await edge.resume(sb)
    assert (await edge.get(sb)).state == SandboxState.suspended   # still parked, unharmed
    with pytest.raises(PressureHigh):
        await edge.create("p", MicroVMArgs(image="busybox"))
    proc.psi("memory", some=0.5, full=0.1)
    clock.t += 1
    assert (await edge.resume(sb)).state == SandboxState.running


def test_claims_age_out_and_pace_admission_near_the_floor(tmp_path: Path) -> None:
    """D100: a claim counts as taken memory for CLAIM_S, then MemAvailable alone decides; a
    refusal caused only by claims says so (claims_only), one by MemAvailable does not."""
    from dsec.edge import admit_wait
    from dsec.edge.admission import MemoryShort
    now = [100.0]
    claims = admit_wait.Claims(clock=lambda: now[0])
    claims.add(48)
    claims.add(48)
    assert claims.held_mb() == 96
    now[0] += admit_wait.CLAIM_S
    assert claims.held_mb() == 0
    (tmp_path / "meminfo").write_text("MemTotal: 8388608 kB\nMemAvailable: 614400 kB\n")   # 600 MiB
    a = Admission(NodeCapacity(cpu_cores=64, memory_mb=1 << 20, max_sandboxes=100), mem_reserve_mb=512,
                  sandbox_mb=8, probe=HostProbe(proc=tmp_path, ttl_s=0))
    st = status()
    a.admit(st, 1, 256, claimed_mb=0)
    with pytest.raises(MemoryShort) as e:
        a.admit(st, 1, 256, claimed_mb=96)
    assert e.value.claims_only and "claimed by creates admitted" in e.value.message
    with pytest.raises(MemoryShort) as e:
        Admission(a.capacity, mem_reserve_mb=700, probe=a.probe).admit(st, 1, 256)
    assert not e.value.claims_only
