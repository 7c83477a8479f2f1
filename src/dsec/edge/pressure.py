"""Measured load of this host for admission: PSI stall averages and MemAvailable.

PSI (/proc/pressure/{cpu,memory,io}, Linux >= 4.20) says what share of the last ~10 s tasks
spent waiting for a resource: `some` = at least one task waited, `full` = every non-idle task
did at once. It measures contention, which is what a new sandbox would add to, where the sum of
requested limits only measures promises (most agents use a small part of what they ask for).

Readings are cached for `ttl_s` (1 s): admission runs per create, and a burst of 100 creates
should read /proc once, not 100 times a millisecond apart; avg10 hardly moves within a second
anyway. The /proc root is a parameter so tests can point it at a fake tree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dsec.edge")

PSI_RESOURCES = ("cpu", "memory", "io")


@dataclass(frozen=True)
class Reading:
    """One look at the host. A value the kernel does not provide is None / absent."""

    mem_available_mb: int | None
    mem_total_mb: int | None
    psi: Mapping[str, float]      # "memory full" -> avg10 in percent

    def stall(self, resource: str, kind: str) -> float | None:
        return self.psi.get(f"{resource} {kind}")


def parse_psi(text: str) -> dict[str, float]:
    """avg10 per line kind of a PSI file: {'some': 1.5, 'full': 0.0}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        for field in rest.split():
            name, _, value = field.partition("=")
            if name == "avg10":
                out[kind] = float(value)
    return out


def parse_meminfo(text: str, keys: tuple[str, ...]) -> dict[str, int]:
    """The given /proc/meminfo keys in MiB (the file says kB)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in keys and rest.split():
            out[key] = int(rest.split()[0]) // 1024
    return out


class HostProbe:
    """Reads /proc/pressure/* and /proc/meminfo, at most once per ttl_s."""

    def __init__(self, proc: Path = Path("/proc"), ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.proc = proc
        self.ttl_s = ttl_s
        self._clock = clock
        self._cached: Reading | None = None
        self._read_at = 0.0
        self._said_missing: set[str] = set()   # what was logged as unavailable (said once)

    def read(self) -> Reading:
        now = self._clock()
        if self._cached is None or now - self._read_at >= self.ttl_s:
            self._cached, self._read_at = self._read_now(), now
        return self._cached

    def _read_now(self) -> Reading:
        mem = parse_meminfo(self._text("meminfo") or "", ("MemAvailable", "MemTotal"))
        if "MemAvailable" not in mem:
            self._say_missing("meminfo", f"{self.proc}/meminfo has no MemAvailable: admission skips "
                                         "the free-memory check")
        psi: dict[str, float] = {}
        for resource in PSI_RESOURCES:
            text = self._text(f"pressure/{resource}")
            if text is None:
                # kernel without CONFIG_PSI, or booted with psi=0 (the file exists but reads fail)
                self._say_missing(resource, f"{self.proc}/pressure/{resource} is not readable (kernel "
                                            f"without PSI?): admission skips the {resource} pressure check")
                continue
            psi.update({f"{resource} {kind}": v for kind, v in parse_psi(text).items()})
        return Reading(mem.get("MemAvailable"), mem.get("MemTotal"), psi)

    def _text(self, rel: str) -> str | None:
        try:
            return (self.proc / rel).read_text()
        except OSError:
            return None

    def _say_missing(self, what: str, message: str) -> None:
        if what not in self._said_missing:
            self._said_missing.add(what)
            log.warning(message)
