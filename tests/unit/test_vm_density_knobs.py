"""The host-memory options of a VM's QEMU (issue 31): the bounded TCG translation cache, guest
RAM marked mergeable for KSM, and the shim that makes all of QEMU's private memory mergeable
(checked on the real kernel through /proc/self/ksm_stat, without QEMU)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.backends.vm import ramshim
from dsec.backends.vm.qemu import Machine


def _machine(**kw) -> Machine:
    base = dict(name="t", kind="microvm", accel="tcg", vcpus=1, memory_mb=256, kernel=Path("/k"),
                initrd=Path("/i"), append="", disks=())
    return Machine(**{**base, **kw})


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_tcg_cache_bound_and_mem_merge_on_the_command_line() -> None:
    a = _machine(tb_size_mb=8, mem_merge=True).argv()
    assert _opt(a, "-accel") == "tcg,tb-size=8"
    assert "mem-merge=on" in _opt(a, "-machine") and "accel=" not in _opt(a, "-machine")
    a = _machine().argv()
    assert _opt(a, "-accel") == "tcg" and "mem-merge=off" in _opt(a, "-machine")
    # KVM has no translation cache: the bound is not passed
    assert _opt(_machine(accel="kvm", tb_size_mb=8).argv(), "-accel") == "kvm"


def test_merge_all_preloads_the_shim_only_when_asked(tmp_path: Path) -> None:
    shim = tmp_path / "shim.so"
    assert _machine(shim=shim).env() == {}
    assert _machine(merge_all=True, shim=shim).env() == {"LD_PRELOAD": str(shim), ramshim.KSM_ALL: "1"}
    # a clone keeps its read-only template RAM as well
    env = _machine(merge_all=True, shim=shim, ram_file=tmp_path / "t.ram", ram_shim=shim).env()
    assert env[ramshim.ENV_PATH] == str(tmp_path / "t.ram") and env[ramshim.KSM_ALL] == "1"


def test_thp_off_preloads_the_shim_with_its_switch(tmp_path: Path) -> None:
    shim = tmp_path / "shim.so"
    assert _machine(thp_off=True, shim=shim).env() == {"LD_PRELOAD": str(shim), ramshim.THP_OFF: "1"}
    env = _machine(thp_off=True, merge_all=True, shim=shim).env()
    assert env[ramshim.THP_OFF] == "1" and env[ramshim.KSM_ALL] == "1"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed (apt-get install gcc)")
def test_the_shim_turns_huge_pages_off_only_with_the_switch(tmp_path: Path) -> None:
    shim = ramshim.build(tmp_path)
    probe = [sys.executable, "-c", "print(open('/proc/self/status').read())"]

    def thp(env: dict[str, str]) -> str | None:
        out = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout
        return next((ln.split()[1] for ln in out.splitlines() if ln.startswith("THP_enabled:")), None)
    if thp({}) is None:
        pytest.skip("kernel without THP_enabled in /proc/PID/status")
    assert thp({"LD_PRELOAD": str(shim), ramshim.THP_OFF: "1"}) == "0"
    assert thp({"LD_PRELOAD": str(shim)}) == "1"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed (apt-get install gcc)")
@pytest.mark.skipif(not Path("/proc/self/ksm_stat").exists(), reason="kernel without /proc/PID/ksm_stat")
def test_the_shim_makes_the_process_mergeable_only_with_the_switch(tmp_path: Path) -> None:
    shim = ramshim.build(tmp_path)
    probe = [sys.executable, "-c", "print(open('/proc/self/ksm_stat').read())"]

    def merge_any(env: dict[str, str]) -> str:
        out = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout
        return next(ln.split(":")[1].strip() for ln in out.splitlines() if ln.startswith("ksm_merge_any"))
    assert merge_any({"LD_PRELOAD": str(shim), ramshim.KSM_ALL: "1"}) == "yes"
    assert merge_any({"LD_PRELOAD": str(shim)}) == "no"
    assert merge_any({"LD_PRELOAD": str(shim), ramshim.KSM_ALL: "0"}) == "no"


def test_tcg_microvm_guests_keep_the_tsc_as_their_clock() -> None:
    """With the TSC frequency given (microvm under TCG) the TSC is declared reliable, so the
    guest keeps a clocksource it can go tickless on; the argument is part of a template's key."""
    from dsec.backends.vm import guest
    line = guest.kernel_cmdline(layers=1, tsc_khz=2_600_000).split()
    assert "tsc_early_khz=2600000" in line and "tsc=reliable" in line
    assert "tsc=reliable" not in guest.kernel_cmdline(layers=1).split()
    assert "tsc=reliable" in guest.TCG_CLOCK_ARGS
