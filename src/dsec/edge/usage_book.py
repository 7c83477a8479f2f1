"""The bookkeeping of per-sandbox usage (usage.py samples): the bounded ring of each sandbox,
which sandboxes are watched and due a sample, and a sample from two raw readings. Apart from
usage.py so that edge/core.py can name UsageBook without an import cycle."""

from __future__ import annotations

import builtins
import math
import time
from collections import deque
from dataclasses import dataclass, field

from dsec.backends.base import RawUsage
from dsec.types import UsageSample

WATCHED_EVERY_S = 5.0     # defaults of DSEC_USAGE_WATCHED_S / DSEC_USAGE_IDLE_S
IDLE_EVERY_S = 60.0
WATCH_FOR_S = 60.0
TICK_S = 1.0
# every sandbox is looked at this often (at most its idle interval); between, only the watched
# ones: a scan of 3,200 every second was ~1.7% of the server's CPU in a create storm (py-spy,
# docs/benchmarks.md), while an idle sample is due once a minute
FULL_SCAN_S = 10.0
FRESH_S = 1.0            # an ask answers with a sample at most this old (one read per ask at most)
FIRST_INTERVAL_S = 0.25   # a sandbox never sampled: two samples this far apart
KEEP = 720            # samples kept per sandbox: an hour at 5 s, 12 hours at 60 s


@dataclass
class _Track:
    samples: deque[UsageSample] = field(default_factory=lambda: deque(maxlen=KEEP))
    last_raw: RawUsage | None = None
    last_at: float = 0.0          # monotonic time of the last sample
    watched_until: float = 0.0    # monotonic


class UsageBook:
    """The rings of the node's sandboxes and who is due a sample."""

    def __init__(self, watched_every_s: float = WATCHED_EVERY_S, idle_every_s: float = IDLE_EVERY_S) -> None:
        self._tracks: dict[str, _Track] = {}
        self._watched: set[str] = set()       # asked for within WATCH_FOR_S (some may have lapsed)
        self.watched_every_s = watched_every_s
        self.idle_every_s = idle_every_s      # 0: not sampled unless watched

    def track(self, sandbox_id: str) -> _Track:
        t = self._tracks.get(sandbox_id)
        if t is None:
            t = self._tracks[sandbox_id] = _Track()
        return t

    def forget(self, sandbox_id: str) -> None:
        self._tracks.pop(sandbox_id, None)
        self._watched.discard(sandbox_id)

    def watch(self, sandbox_id: str, now: float) -> None:
        self.track(sandbox_id).watched_until = now + WATCH_FOR_S
        self._watched.add(sandbox_id)

    def watched_ids(self, now: float) -> builtins.list[str]:
        """The sandboxes watched now (O(watched): lapsed ones are dropped here)."""
        out = []
        for sid in list(self._watched):
            t = self._tracks.get(sid)
            if t is not None and t.watched_until > now:
                out.append(sid)
            else:
                self._watched.discard(sid)
        return out

    @property
    def scan_every_s(self) -> float:
        """How often every sandbox is looked at (not only the watched ones)."""
        return min(FULL_SCAN_S, self.idle_every_s) if self.idle_every_s else FULL_SCAN_S

    def due(self, sandbox_id: str, now: float) -> bool:
        t = self._tracks.get(sandbox_id)
        watched = t is not None and t.watched_until > now
        if not watched and not self.idle_every_s:
            return False
        if t is None:
            return True
        return now - t.last_at >= (self.watched_every_s if watched else self.idle_every_s)

    def watched_count(self) -> int:
        return len(self.watched_ids(time.monotonic()))

    def ids(self) -> builtins.list[str]:
        return list(self._tracks)


def to_sample(raw: RawUsage, prev: RawUsage | None, dt: float, cpu_cores: float, memory_mb: int,
              disk_mb: int | None) -> UsageSample:
    cpus = max(1, math.ceil(cpu_cores))
    # percent of the cores it may use since the last sample (0 for the first one: no interval)
    pct = 0.0
    if prev is not None and dt > 0:
        pct = max(0.0, (raw.cpu_ns - prev.cpu_ns) / (dt * 1e9) / cpu_cores * 100.0)
    return UsageSample(timestamp=time.time(), cpu_count=cpus, cpu_used_pct=round(min(pct, 100.0), 2),
                       mem_used=raw.mem_bytes - raw.mem_cache, mem_cache=raw.mem_cache,
                       mem_total=memory_mb << 20, disk_used=raw.disk_bytes or 0,
                       disk_total=(disk_mb or 0) << 20, net_rx_bytes=raw.net_rx, net_tx_bytes=raw.net_tx)
