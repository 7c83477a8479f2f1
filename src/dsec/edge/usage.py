"""Per-sandbox usage: sampled from the backend (UsageStats: cgroups, a VM's QEMU), kept in a
bounded ring per sandbox for its life, served by the `usage` verb (sb.metrics(), `dsec
sandbox top`, E2B's get_metrics).

Sampling rate: every DSEC_USAGE_WATCHED_S (5 s) for a sandbox whose usage was asked for in the
last WATCH_FOR_S, else every DSEC_USAGE_IDLE_S (60 s; 0: never) (one cgroup-v1 sample costs tens of microseconds: 3,200
sandboxes at 60 s is ~1 ms of CPU a second; docs/benchmarks.md). Parked sandboxes are not
sampled (nothing of theirs runs).
"""

from __future__ import annotations

import asyncio
import builtins
import time
from time import perf_counter     # not the unit tests' fake clock (tests/unit/conftest.py)

from dsec import metrics
from dsec.backends.base import RawUsage, UsageStats
from dsec.edge.core import EdgeCore, log
from dsec.edge.usage_book import FIRST_INTERVAL_S, FRESH_S, TICK_S, to_sample
from dsec.types import SandboxState, UsageSample


class UsageVerbs(EdgeCore):
    async def usage(self, sandbox_id: str, start: float | None = None,
                    end: float | None = None) -> builtins.list[UsageSample]:
        """The sandbox's usage samples between start and end (Unix seconds), oldest first; from
        now on it is sampled every 5 s for a minute. A running one whose last sample is older
        than FRESH_S is sampled now. Ended sandboxes keep none (NotFound for unknown ones, as `get`)."""
        rec = self._record(sandbox_id)
        live = self._live.get(rec.id)
        if live is None:
            return []            # ended: its samples went with it
        now = time.monotonic()
        self._usage.watch(rec.id, now)
        track = self._usage.track(rec.id)
        if rec.state == SandboxState.running:
            if track.last_raw is None:
                await self._sample(rec.id)
            # a first sample says no CPU use (no interval yet): answer with a second one
            if len(track.samples) < 2 or now - track.last_at >= FRESH_S:
                wait = FIRST_INTERVAL_S - (time.monotonic() - track.last_at)
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._sample(rec.id)
        return [s for s in track.samples
                if (start is None or s.timestamp >= start) and (end is None or s.timestamp <= end)]

    async def _sample(self, *sandbox_ids: str) -> None:
        """One sample of each (the reads in one worker thread: no thread hop per sandbox)."""
        lives = [live for sid in sandbox_ids if (live := self._live.get(sid)) is not None
                 and live.rec.state == SandboxState.running and isinstance(live.backend, UsageStats)]

        def read_all() -> builtins.list[tuple[RawUsage | None, float]]:
            out = []
            for live in lives:
                t0 = perf_counter()
                raw = live.backend.usage(live.id)     # type: ignore[attr-defined]
                out.append((raw, time.monotonic()))
                metrics.USAGE_SAMPLE_SECONDS.observe(perf_counter() - t0)
            return out

        for live, (raw, at) in zip(lives, await asyncio.to_thread(read_all)):
            if raw is None:
                continue
            rec = live.rec
            metrics.USAGE_SAMPLES.labels(rec.backend).inc()
            track = self._usage.track(live.id)
            track.samples.append(to_sample(raw, track.last_raw, at - track.last_at, rec.args.cpu_cores,
                                           rec.args.memory_mb, getattr(rec.args, "disk_mb", None)))
            track.last_raw, track.last_at = raw, at

    async def _sample_loop(self) -> None:
        """Once a second: sample the watched sandboxes that are due; every scan_every_s, look at
        all of them (idle ones due, new ones) and forget the ones that ended."""
        next_scan = 0.0
        while True:
            await asyncio.sleep(TICK_S)
            try:
                now = time.monotonic()
                if now >= next_scan:
                    next_scan = now + self._usage.scan_every_s - TICK_S / 2
                    for gone in set(self._usage.ids()) - set(self._live):
                        self._usage.forget(gone)
                    look = list(self._live.items())
                else:
                    look = [(sid, live) for sid in self._usage.watched_ids(now)
                            if (live := self._live.get(sid)) is not None]
                due = [sid for sid, live in look
                       if live.rec.state == SandboxState.running and self._usage.due(sid, now)]
                if due:
                    await self._sample(*due)
            except Exception:
                log.exception("usage sampling failed")
