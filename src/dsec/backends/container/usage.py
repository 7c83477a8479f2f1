"""A container sandbox's usage from its cgroups (v1 and v2) and its host-side veth: a few small
reads (~20 us each with cgroup v1 here), cheap enough to sample every 5 s (edge/usage.py)."""

from __future__ import annotations

from pathlib import Path

from dsec.backends.base import RawUsage
from dsec.backends.container import cgroups
from dsec.backends.container.network import veth_name


def _stat(f: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in f.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.isdigit():
            out[key] = int(value)
    return out


def _net(sandbox_id: str) -> tuple[int | None, int | None]:
    """The host end of the sandbox's veth: what it receives is what the sandbox sent."""
    d = Path("/sys/class/net") / veth_name(sandbox_id) / "statistics"
    try:
        return int((d / "tx_bytes").read_text()), int((d / "rx_bytes").read_text())
    except (OSError, ValueError):
        return None, None     # no veth: the sandbox has no network device beside lo


def read(rel: str, sandbox_id: str, v2: bool) -> RawUsage:
    """Raises OSError when the cgroup is gone (the sandbox ended under us)."""
    if v2:
        d = cgroups.v2_dir(rel)
        cpu_ns = _stat(d / "cpu.stat")["usage_usec"] * 1000
        mem = int((d / "memory.current").read_text())
        cache = _stat(d / "memory.stat").get("file", 0)
    else:
        cpu_ns = int((cgroups.v1_dir("cpuacct", rel) / "cpuacct.usage").read_text())
        m = cgroups.v1_dir("memory", rel)
        mem = int((m / "memory.usage_in_bytes").read_text())
        stat = _stat(m / "memory.stat")
        cache = stat.get("total_cache", stat.get("cache", 0))
    rx, tx = _net(sandbox_id)
    return RawUsage(cpu_ns=cpu_ns, mem_bytes=mem, mem_cache=min(cache, mem), disk_bytes=None, net_rx=rx, net_tx=tx)
