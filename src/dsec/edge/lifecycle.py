"""Sandboxes come and go: create (idempotent, warm-pool claims), recovery after an edge
restart, get/list, stop, failure when a runtime exits.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import time

from dsec import tracing
from dsec.backends.base import PARKED, RUNNING, MemoryUsage
from dsec.backends.warm import WarmClaim
from dsec.edge.live import LiveSandbox
from dsec.edge.timing import CreateTimer
from dsec.edge.records import SandboxRecord
from dsec.types import (END_REASONS, EventType, DsecError, ImageInfo, InvalidArgument,
                        SandboxArgs,
                        SandboxFailed, SandboxInfo, SandboxState, Unavailable, make_sandbox_id)
from dsec.edge.core import LIVE, EdgeCore, log


class Lifecycle(EdgeCore):
    async def _recover(self) -> None:
        """Adopt what still runs, fail what does not. A sandbox (or a backend) that cannot be
        read or torn down, e.g. on a filesystem gone read-only after an I/O error, is marked
        failed with that error and logged; recovery goes on with the others."""
        runtime: dict[int, dict[str, str]] = {}
        unlisted: dict[int, str] = {}
        for each in self._distinct_backends():
            try:
                runtime[id(each)] = await each.list_ids()
            except Exception as e:
                runtime[id(each)] = {}
                unlisted[id(each)] = f"could not list the {each.kinds[0]} backend's sandboxes: {e!r}"
                log.exception("recovery could not list a backend's sandboxes", extra={"backend": each.kinds[0]})
        for rec in self.records.load(LIVE):
            b = self._backends.get(rec.backend)
            seen = runtime[id(b)].get(rec.id) if b is not None else None
            if b is not None and rec.state == SandboxState.running and seen == PARKED:
                # the edge died after a park finished, before it recorded it: parked it is
                rec.state = SandboxState.suspended
                self.records.set_state(rec.id, SandboxState.suspended)
            if b is not None and ((rec.state == SandboxState.running and seen == RUNNING)
                                  or (rec.state == SandboxState.suspended and seen == PARKED)):
                self._live[rec.id] = LiveSandbox(rec, b)   # a parked one resumes on its next request
                self._load.update(rec, live=True)
                self._schedule(rec)
                continue
            reason = {SandboxState.creating: "edge restarted while creating the sandbox",
                      SandboxState.running: "the sandbox died while the edge was down",
                      SandboxState.suspended: "the parked sandbox's saved state was lost"}.get(rec.state)
            if b is not None and id(b) in unlisted:
                reason = unlisted[id(b)]
            final = SandboxState.stopped if rec.state == SandboxState.stopping else SandboxState.failed
            end = "killed" if final == SandboxState.stopped else "node_lost"   # its node restarted under it
            if b is not None:
                try:
                    await b.destroy(rec.id)
                except Exception as e:
                    final, reason = SandboxState.failed, f"{reason or 'recovery'}; could not tear it down: {e!r}"
                    log.exception("recovery could not tear down a sandbox", extra={"sandbox": rec.id})
            self.records.set_state(rec.id, final, reason, end_reason=end)
            self._emit(EventType.ended, rec, reason=end, message=reason)
            log.warning("recovered sandbox", extra={"sandbox": rec.id, "was": rec.state.value, "now": final.value})
        # Anything a runtime or its disk holds that no live record owns is an orphan.
        for b in self._distinct_backends():
            for orphan in set(runtime[id(b)]) - set(self._live):
                log.warning("removing orphan sandbox", extra={"sandbox": orphan, "backend": b.kinds[0]})
                try:
                    await b.destroy(orphan)
                except Exception:
                    log.exception("could not remove an orphan sandbox", extra={"sandbox": orphan})
            try:
                await b.recover({i for i, live in self._live.items() if live.backend is b})
            except Exception:
                log.exception("backend recovery failed", extra={"backend": b.kinds[0]})
        for live in list(self._live.values()):
            if live.rec.state == SandboxState.running:
                self._watch_exit(live)

    async def create(self, project: str, args: SandboxArgs) -> SandboxInfo:
        """Create a sandbox. With an idempotency key, a retry (after a timeout, a lost
        connection) returns the sandbox the first request made or is making."""
        key = args.idempotency_key
        if key is None:
            return await self._create(project, args)
        pending = self._creating_keys.get((project, key))
        if pending is None:   # registered before any await: a concurrent retry finds it
            pending = asyncio.create_task(self._create_once(project, key, args), name=f"create-{key}")
            self._creating_keys[(project, key)] = pending
            pending.add_done_callback(lambda _: self._creating_keys.pop((project, key), None))
        # shielded: a caller that gives up does not abort the creation its retry will return
        return await asyncio.shield(pending)

    async def _create_once(self, project: str, key: str, args: SandboxArgs) -> SandboxInfo:
        """The sandbox an earlier create with this key made, else a new one."""
        # inline, as the record's insert is: one indexed read, cheaper than a thread hop (D97)
        earlier = self.records.find_idempotent(project, key)
        if earlier is not None:
            return self._record(earlier.id).info(self.node_id)
        return await self._create(project, args)

    async def _create(self, project: str, args: SandboxArgs) -> SandboxInfo:
        """One path for every backend: prepare (validate, resolve), admit, record, create,
        wait for the agent. A failure anywhere leaves a failed record and nothing else. A
        request that matches a warm pool (warm_pool.py) claims one of its idle sandboxes
        instead of starting one: same record, same checks, its limits applied at claim."""
        t0 = time.monotonic()
        stages = CreateTimer(args.backend, project)
        try:
            if tracing.on():      # the stages become child spans (CreateTimer.lap)
                with tracing.span("dsec.edge.create", attrs={"dsec.backend": args.backend, "dsec.project": project,
                                                             "dsec.node": self.node_id}) as s:
                    info = await self._create_timed(project, args, stages)
                    tracing.set_attrs(s, {"dsec.sandbox_id": info.id, "dsec.warm": stages.warm})
            else:
                info = await self._create_timed(project, args, stages)
        except DsecError:
            stages.done("refused" if stages.refused else "failed")
            raise
        except Exception:
            stages.done("failed")
            raise
        stages.done("ok")
        log.info("sandbox created", extra={"sandbox": info.id, "backend": args.backend, "image": args.image,
                                           "project": project, "accel": getattr(args, "accel", None),
                                           "warm": stages.warm, "ms": round((time.monotonic() - t0) * 1000, 2)})
        return info

    async def _create_timed(self, project: str, args: SandboxArgs, stages: CreateTimer) -> SandboxInfo:
        backend = self._backend(args.backend)
        prepared = await backend.prepare(args, self.stacks)   # DsecErrors name the field
        args = prepared.args
        prepared.volumes = await self._resolve_volumes(project, args)    # volumes.py
        stages.lap("prepare")
        self._pools.note_create()   # refills wait until creates pause
        # a warm sandbox has no volumes mounted: one that asks for some starts afresh
        warm = None if prepared.volumes else self._take_warm(backend, prepared)
        stages.warm = warm is not None
        if warm is not None:   # its share of the node passes to this sandbox
            self._load.update(warm.rec, live=False)
        try:
            # short of memory: waits (bounded) for idle reclaim under way (admit_wait.py, D95),
            # paced by what was admitted a moment ago (D100); the node's automatic warm pools
            # give way first (warm.py)
            await self._admit_tenant(args.cpu_cores, args.memory_mb, getattr(backend, "start_resident_mb", 0))
        except DsecError as e:
            self._give_back_warm(warm)
            stages.refuse(e)
            raise
        except BaseException:
            self._give_back_warm(warm)
            raise
        stages.lap("admission")
        now = time.time()
        rec = SandboxRecord(id=warm.id if warm else make_sandbox_id(self.node_id), project=project,
                            backend=args.backend,
                            state=SandboxState.creating, args=args, image=args.image,
                            image_digest=prepared.image_digest, uid=prepared.uid, gid=prepared.gid,
                            created_at=now, last_active_at=now,
                            expires_at=now + args.lifetime_s if args.lifetime_s is not None else None)
        live = LiveSandbox(rec, backend)
        try:
            self.records.insert(rec)   # durable before anything exists on the host (or is claimed)
        except Exception as e:     # e.g. "database or disk is full"
            self._give_back_warm(warm)
            raise Unavailable(f"node {self.node_id} cannot record a new sandbox in {self.paths.edge_db}: {e}",
                              fix="free space on the DSEC_HOME filesystem, then retry") from e
        self._live[rec.id] = live
        self._load.update(rec, live=True)
        if prepared.image_digest:   # its layers are pulled and mounted on this node from here on
            self._cached_images.add(prepared.image_digest)
        try:
            if warm is None:
                async with self._create_slots:   # a burst starts a few at a time
                    stages.lap("slot")           # the wait for a start slot, apart from the start
                    await backend.create(rec.id, prepared, self.stacks)
                stages.lap("start")
                await self._adopt_agent(live, fresh=backend.fresh_agent_at_create)   # ready: the agent answers
                stages.lap("agent")
            else:
                # its connected agent, the sandbox's from here (its teardown closes it); no
                # round trip: nothing ever ran in it (chan 1 is free), and a dead agent shows
                # as a closed connection (_take_warm) or fails the first request (_check_alive)
                live.agent = warm.agent
                assert isinstance(backend, WarmClaim)
                await backend.claim(rec.id, prepared)   # the caller's limits and network policy
        except BaseException as e:
            await asyncio.shield(self._abort_create(live, e))
            if isinstance(e, DsecError) or not isinstance(e, Exception):
                raise          # cancellation and interrupts go on as they are
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
                raise Unavailable(f"sandbox creation failed: node {self.node_id}'s storage: {e}",
                                  fix="free space on the node's DSEC_HOME filesystem (a read-only scratch "
                                      "filesystem needs dsec stopped, DSEC_HOME/sb unmounted and a restart)") from e
            raise SandboxFailed(f"sandbox creation failed: {e!r}") from e
        rec.state = SandboxState.running
        self.records.set_state(rec.id, SandboxState.running)
        self._emit(EventType.created, rec, backend=rec.backend, image=rec.image, cpu_cores=rec.cpu_cores,
                   memory_mb=rec.memory_mb, labels=dict(rec.args.labels), warm=warm is not None)
        self._watch_exit(live)
        self._schedule(rec)
        return rec.info(self.node_id)

    async def _abort_create(self, live: LiveSandbox, error: BaseException) -> None:
        """A creation that failed leaves nothing: no agent channel, no runtime, a failed record
        (failed even when the teardown fails too, e.g. on a broken disk: it says so)."""
        reason = f"creation failed: {error!s}"
        try:
            await self._teardown(live)
        except Exception as e:
            reason += f"; its teardown failed too: {e!r}"
            log.exception("teardown after a failed create failed", extra={"sandbox": live.id})
        live.rec.state, live.rec.end_reason = SandboxState.failed, "create_failed"
        try:
            self.records.set_state(live.id, SandboxState.failed, reason, end_reason="create_failed")
        except Exception:   # the record stays `creating`: the next start's recovery fails it
            log.exception("could not record a failed create", extra={"sandbox": live.id})
        self._emit(EventType.ended, live.rec, reason="create_failed", message=reason)
        log.error("create failed", extra={"sandbox": live.id, "error": str(error) or repr(error)})

    async def _adopt_agent(self, live: LiveSandbox, fresh: bool = False) -> None:
        """First connection after a start or resume, then the backend's own readiness step
        (a restored VM gets its clock and entropy: it copies another guest, or stood still)."""
        agent = await live.backend.wait_agent(live.id)
        await live.adopt(agent, fresh)
        await live.backend.ready(live.id, agent)

    async def _teardown(self, live: LiveSandbox) -> None:
        """Free everything of a sandbox: the edge's side (live object, agent) and the backend's."""
        self._live.pop(live.id, None)
        self._load.update(live.rec, live=False)
        self._deadlines.forget(live.id)
        await live.close()
        await live.backend.destroy(live.id)

    async def get(self, sandbox_id: str, usage: bool = False) -> SandboxInfo:
        """The sandbox's record; with `usage`, also what it costs the host now (a /proc read:
        not for the ownership check every request makes)."""
        rec = self._record(sandbox_id)
        info = rec.info(self.node_id)
        live = self._live.get(sandbox_id)
        if (usage and live is not None and rec.state in (SandboxState.running, SandboxState.suspended)
                and isinstance(live.backend, MemoryUsage)):
            b = live.backend
            pss, swapped = await asyncio.to_thread(lambda: (b.pss(rec.id), b.swapped(rec.id)))
            mib = lambda n: round(n / (1 << 20), 1) if n is not None else None  # noqa: E731
            info.host_pss_mb, info.host_swap_mb = mib(pss), mib(swapped)
        return info

    async def list(self, project: str | None = None, include_ended: bool = False) -> builtins.list[SandboxInfo]:
        recs = self.records.load() if include_ended else [x.rec for x in self._live.values()]
        # live records carry fresher state/activity than the database
        recs = [self._live[r.id].rec if r.id in self._live else r for r in recs]
        return [r.info(self.node_id) for r in recs if project is None or r.project == project]

    async def resolve_image(self, name: str, field: str = "image") -> ImageInfo:
        """An image by name (cached briefly), NotFound naming `field`."""
        return await self.stacks.resolve(name, field)

    async def stop(self, sandbox_id: str, reason: str | None = None, end: str = "killed") -> SandboxInfo:
        """Stop it; `reason` the free text its record keeps, `end` the end reason its event
        says (types/events.py: 'killed' for a caller's stop, 'ttl'/'lifetime' for the reaper's,
        'preempted' for the platform's own, e.g. `dsec nodes drain --stop`)."""
        if end not in END_REASONS:
            raise InvalidArgument(f"{end!r} is not an end reason", field="end",
                                  fix=f"use one of: {', '.join(sorted(END_REASONS))}")
        rec = self._record(sandbox_id)
        if rec.state in (SandboxState.stopped, SandboxState.failed):
            return rec.info(self.node_id)
        rec.state = SandboxState.stopping
        self._load.update(rec, live=rec.id in self._live)
        self.records.set_state(rec.id, SandboxState.stopping)
        live = self._live.get(rec.id)
        if live is not None:
            await self._teardown(live)
        rec.state, rec.error, rec.end_reason = SandboxState.stopped, reason or rec.error, end
        rec.ended_at = time.time()
        self.records.set_state(rec.id, SandboxState.stopped, reason, end_reason=end)
        self._emit(EventType.ended, rec, reason=end, message=reason or "stopped on request")
        log.info("sandbox stopped", extra={"sandbox": rec.id, "reason": reason or "requested"})
        return rec.info(self.node_id)

    async def _fail(self, live: LiveSandbox, reason: str, end: str = "agent_died") -> None:
        """Fail it: `reason` the free text, `end` the end reason (types/events.py)."""
        rec = live.rec
        if rec.state == SandboxState.failed:
            return                                  # already failed by another path
        # state first: requests woken by the teardown below must already see why
        rec.state, rec.error, rec.ended_at = SandboxState.failed, reason + live.backend.log_tail(rec.id), time.time()
        rec.end_reason = end
        self.records.set_state(rec.id, SandboxState.failed, rec.error, end_reason=end)
        self._emit(EventType.ended, rec, reason=end, message=rec.error)
        await self._teardown(live)
        log.error("sandbox failed", extra={"sandbox": rec.id, "reason": rec.error})

    def _watch_exit(self, live: LiveSandbox) -> None:
        """Notice the sandbox's death between requests where its backend can watch its runtime:
        it is failed with the backend's end_reason() at once (no longer admitted, no 'idle')."""
        live.backend.watch_exit(live.id, lambda: self._exited(live))

    def _exited(self, live: LiveSandbox) -> None:
        if self._live.get(live.id) is not live or live.rec.state != SandboxState.running:
            return                          # stopping, parked or gone: not news
        task = asyncio.create_task(self._fail_exited(live), name=f"exited-{live.id}")
        self._exit_tasks.add(task)
        task.add_done_callback(self._exit_tasks.discard)

    async def _fail_exited(self, live: LiveSandbox) -> None:
        try:
            if live.rec.state == SandboxState.running and not await live.backend.is_running(live.id):
                await self._fail(live, live.backend.end_reason(live.id, None), live.backend.end_code(live.id))
        except Exception:
            log.exception("could not fail an exited sandbox", extra={"sandbox": live.id})
