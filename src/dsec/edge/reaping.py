"""The reaper: TTLs, idle parking, disk quota polling, liveness checks.
"""

from __future__ import annotations

import asyncio
import builtins
import time
from typing import Any

from dsec.agent.client import AgentError
from dsec.backends.base import Doze, LivenessWatched
from dsec.edge.live import LiveSandbox
from dsec.edge.records import SandboxRecord
from dsec.types import DsecError, SandboxState
from dsec.edge.core import PURGE_EVERY_S, _park_after, EdgeCore, log
from dsec.edge.event_log import KEEP_S as EVENTS_KEEP_S


class Reaping(EdgeCore):
    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            try:
                await self.reap_once()
                self._reclaimer.tick()          # starts idle reclaims in the background
                await self._poll_disk()
                await self._check_liveness()
            except Exception:  # the reaper must outlive any single bad sandbox
                log.exception("reaper iteration failed")

    def _running_of(self, pred: Any) -> builtins.list[LiveSandbox]:
        return [x for x in self._live.values() if x.rec.state == SandboxState.running and pred(x.backend)]

    async def _poll_disk(self) -> None:
        """Fallback disk quota (backends whose kernel side cannot enforce disk_mb here): every
        DSEC_DISK_POLL_S, measure each running sandbox's writable layer and fail the ones beyond
        disk_mb, saying so in their error."""
        if time.monotonic() < self._disk_next:
            return
        self._disk_next = time.monotonic() + self.conf.storage.disk_poll_s
        for live in self._running_of(lambda b: not b.disk_enforced):
            limit = live.rec.args.disk_mb << 20
            used = await asyncio.to_thread(live.backend.disk_usage, live.id)
            if used > limit and live.rec.state == SandboxState.running:
                await self._fail(live, f"disk quota exceeded: the writable layer holds {used >> 20} MiB, "
                                       f"more than disk_mb={limit >> 20}", "disk_quota")

    async def _check_liveness(self) -> None:
        """Sandboxes of LivenessWatched backends whose runtime has exited are marked failed at
        once, with the reason from what they left; their agents are pinged now and then."""
        watched = self._running_of(lambda b: isinstance(b, LivenessWatched))
        for live in watched:
            if not await live.backend.is_running(live.id) and live.rec.state == SandboxState.running:
                await self._fail(live, live.backend.end_reason(live.id, None), live.backend.end_code(live.id))
        due = []
        for b in {id(x.backend): x.backend for x in watched}.values():
            assert isinstance(b, LivenessWatched)
            if time.monotonic() >= self._next_ping.get(id(b), 0.0):
                self._next_ping[id(b)] = time.monotonic() + b.ping_interval_s
                due.append(b)
        # A guest that stopped scheduling (hung kernel, stuck vCPU, a reboot that spins)
        # keeps its runtime alive: only its agent's silence tells. Busy ones too: a request in
        # flight to a dead guest would otherwise wait forever; failing the sandbox ends it.
        # a dozing VM (Doze) answers nothing until woken; is_running above still watches it
        await asyncio.gather(*(self._ping(x) for x in watched
                               if x.backend in due and x.rec.state == SandboxState.running
                               and not (isinstance(x.backend, Doze) and x.backend.dozing(x.id))))

    async def _ping(self, live: LiveSandbox) -> None:
        b = live.backend
        assert isinstance(b, LivenessWatched)
        try:
            agent = await asyncio.wait_for(live.connect(), b.ping_timeout_s)
            await asyncio.wait_for(agent.ping(), b.ping_timeout_s)
            live.ping_misses = 0
        except (OSError, ConnectionError, asyncio.TimeoutError, AgentError):
            # the connection stays: requests in flight keep it, and a late PONG goes to its own
            # (abandoned) chan and is dropped; a dead connection is replaced by the next connect()
            live.ping_misses += 1
            now = time.monotonic()
            if live.ping_misses == 1:
                live.ping_missed_since = now
            if live.ping_misses < b.ping_misses or live.rec.state != SandboxState.running:
                return
            silent = now - live.ping_missed_since
            stall = self._host_stall()
            if stall is not None and silent < self.conf.edge.liveness_stall_max_s:
                # a starved or thrashing host delays every guest's answer: failing them then
                # turns a slow host into hundreds of lost sandboxes (D100). Asked again at the
                # next ping; a guest still silent once the stall is over (or after the bound) fails
                log.info("guest not answering while the host is stalled: not failed yet",
                         extra={"sandbox": live.id, "misses": live.ping_misses, "silent_s": round(silent, 1),
                                "stall": stall})
                return
            await self._fail(live, f"the guest stopped answering (hung): no reply to {live.ping_misses} "
                                   f"pings {b.ping_interval_s:.0f}s apart")

    def _host_stall(self) -> str | None:
        """'cpu some 97%' when the host's PSI cpu or memory some avg10 is at or above
        DSEC_LIVENESS_STALL_PSI, else None."""
        limit = self.conf.edge.liveness_stall_psi
        if limit >= 100:
            return None
        reading = self.admission.probe.read()
        for resource in ("cpu", "memory"):
            v = reading.stall(resource, "some")
            if v is not None and v >= limit:
                return f"{resource} some {v:g}%"
        return None

    def _schedule(self, rec: SandboxRecord) -> None:
        """Tell the reaper when to look at this sandbox next: the earliest of its idle TTL, idle
        parking and absolute lifetime (activity moves them later; the reaper re-reads them)."""
        if rec.state not in (SandboxState.running, SandboxState.suspended):
            return
        self._reclaimer.watch(rec)
        when = rec.last_active_at + rec.ttl_idle_s
        if rec.expires_at is not None:
            when = min(when, rec.expires_at)
        park_after = _park_after(rec)
        if park_after and rec.state == SandboxState.running:
            when = min(when, rec.last_active_at + park_after)
        self._deadlines.push(rec.id, when)     # in the past (busy, retrying): the next tick

    async def _pause_at_timeout(self, r: SandboxRecord) -> None:
        """on_timeout='pause': the end of the lifetime parks the sandbox instead of ending it
        ; its lifetime is cleared, and the resume that its next
        request makes starts a fresh one (ParkingVerbs.resume). A park that fails leaves it
        running with its lifetime due: the next tick tries again. A request in flight defers
        it to a tick after that request (a pause, unlike a stop, need not cut a reply short);
        detached commands do not (each holds a request's count while the edge follows it, and
        they run on across the park)."""
        live = self._live.get(r.id)
        followed = sum(1 for t in live.commands.tracked.values() if not t.done and t.task is not None) if live else 0
        if r.state == SandboxState.running and r.in_flight > followed:
            return
        # cleared first: a request that resumes it right after the park must find no lifetime
        # (and start a fresh one), not the one that just ended
        ended, r.expires_at = r.expires_at, None
        if r.state == SandboxState.running:
            try:
                await self.suspend(r.id)
            except DsecError as e:
                r.expires_at = ended
                log.warning("could not pause sandbox at its timeout", extra={"sandbox": r.id, "error": e.message})
                return
        await asyncio.to_thread(self.records.set_expires_at, r.id, r.expires_at)
        log.info("sandbox paused at its timeout", extra={"sandbox": r.id})

    async def reap_once(self) -> builtins.list[str]:
        """Stop sandboxes idle past their TTL or past their lifetime, park idle ones that ask for
        it. Looks only at sandboxes whose deadline has come (Deadlines), never at all of them."""
        self._flush_activity()
        now = time.time()
        reaped: builtins.list[str] = []
        for sid in self._deadlines.due(now):
            live = self._live.get(sid)
            if live is None:
                continue
            r = live.rec
            if r.state not in (SandboxState.running, SandboxState.suspended):
                continue
            if r.in_flight == 0 and now - r.last_active_at > r.ttl_idle_s:
                await self.stop(r.id, reason=f"idle for more than ttl_idle_s={r.ttl_idle_s}s", end="ttl")
                reaped.append(r.id)
                continue
            if r.expires_at is not None and now >= r.expires_at and getattr(r.args, "on_timeout", "stop") == "pause":
                await self._pause_at_timeout(r)
                self._schedule(r)
                continue
            if r.expires_at is not None and now >= r.expires_at:   # busy or not
                await self.stop(r.id, reason="its lifetime ended (lifetime_s / set_timeout)", end="lifetime")
                reaped.append(r.id)
                continue
            park_after = _park_after(r)
            if (park_after and r.state == SandboxState.running and r.in_flight == 0
                    and now - r.last_active_at > park_after):
                try:
                    await self.suspend(r.id)
                except DsecError as e:   # it keeps running; the next pass retries
                    log.warning("could not park idle sandbox", extra={"sandbox": r.id, "error": e.message})
            self._schedule(r)          # busy, parked, or used since: look again later
        if time.monotonic() >= self._purge_next:
            self._purge_next = time.monotonic() + PURGE_EVERY_S
            self.records.purge_ended(now - self.settings.keep_ended_s)
            self.events.purge(now - EVENTS_KEEP_S)
            for b in self._distinct_backends():
                b.purge(now - self.settings.keep_ended_s)
        return reaped
