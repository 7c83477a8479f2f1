"""The edge's hooks for warm pools (warm_pool.py, docs/decisions.md D28): what a pool
sandbox is, how one is started, claimed, given back and dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Any

from dsec.backends.base import Backend, Prepared, Reclaim
from dsec.backends.warm import WarmClaim
from dsec.edge.warm_pool import ENV as WARM_ENV
from dsec.edge.warm_pool import MAX_SIZE, PoolTarget, WarmSandbox, parse_targets
from dsec.edge import admit_wait
from dsec.edge.records import SandboxRecord
from dsec.types import MAX_TTL_S, ContainerArgs, DsecError, InvalidArgument, SandboxState, make_sandbox_id
from dsec.edge.core import WARM_PROJECT, WARM_LABEL, WARM_CPU_CORES, WARM_MEMORY_MB, EdgeCore, log


class WarmHooks(EdgeCore):
    def _take_warm(self, backend: Backend, prepared: Prepared) -> WarmSandbox | None:
        """An idle pool sandbox for this request (its agent still connected), or None. The
        create counts towards a burst of its shape (automatic pools, warm_auto.py)."""
        if not isinstance(backend, WarmClaim):
            return None
        key = backend.warm_key(prepared)
        if key is not None and prepared.args.image:
            self._pools.observe(prepared.args.image, key)
        while (w := self._pools.take(key)) is not None:
            if not w.agent.closed:
                return w
            task = asyncio.create_task(self._warm_drop(w), name=f"warm-drop-{w.id}")   # died while waiting
            self._exit_tasks.add(task)
            task.add_done_callback(self._exit_tasks.discard)
        return None

    def _give_back_warm(self, warm: WarmSandbox | None) -> None:
        if warm is not None:
            self._load.update(warm.rec, live=True)
            self._pools.give_back(warm)

    def _drop_auto_pools(self, reason: str) -> bool:
        """A tenant's create was refused or waits: the automatic pools end now, their share of
        the node released at once (their sandboxes are destroyed in the background). True when
        any idle one was freed (admission may now answer otherwise)."""
        freed = self._pools.drop_auto(reason)
        for w in freed:
            self._load.update(w.rec, live=False)
        return bool(freed)

    async def _admit_tenant(self, cpu_cores: float, memory_mb: int, claim_mb: int = 0) -> None:
        """Admission of a tenant's create. The node's automatic pools never cost a tenant a
        sandbox or a wait: refused, they are dropped and it is asked once more; short of memory,
        they are dropped before the create waits for reclaim (admit_wait.py)."""
        def short() -> None:
            self._drop_auto_pools("a create waited for memory")

        async def admit(on_short: Callable[[], None] | None) -> None:
            await admit_wait.admit(self.admission, self._node_status, self._reclaimer, cpu_cores, memory_mb,
                                   self.conf.edge.admit_reclaim_wait_s, self._claims, claim_mb, on_short=on_short)
        try:
            await admit(short)
        except DsecError as e:
            if not self._drop_auto_pools(f"a create was refused: {e.message}"):
                raise
            await admit(None)

    async def _auto_room(self, t: PoolTarget) -> str | None:
        """Why an automatic pool may not start one more sandbox now: it must leave admission
        and MemAvailable room for itself plus a margin (DSEC_WARM_POOL_AUTO_MARGIN_MB, a tenth
        of the node's count and ceilings, half of each pressure limit), so no tenant's create is
        refused or waits because of it."""
        st = await self._node_status()
        cap, margin_mb = st.capacity, self.conf.edge.warm_pool_auto_margin_mb
        if st.sandboxes + 1 > cap.max_sandboxes * 0.9:
            return f"no room: {st.sandboxes} of {cap.max_sandboxes} sandboxes (automatic pools keep 10% free)"
        if st.committed_memory_mb + WARM_MEMORY_MB > cap.memory_mb * 0.9 or \
                st.committed_cpu_cores + WARM_CPU_CORES > cap.cpu_cores * 0.9:
            return "no room: committed limits near the node's ceilings (automatic pools keep 10% free)"
        if st.pressure >= 0.5:
            return f"no room: the node is under pressure ({st.pressure:g} of a refusal's PSI limit)"
        avail = self.admission.probe.read().mem_available_mb
        floor = max(self.admission.mem_reserve_mb + self.admission.sandbox_mb, self.conf.edge.reclaim_mem_low_mb)
        if avail is not None and avail < floor + margin_mb:
            return (f"no room: MemAvailable {avail} MiB < {floor} MiB (reserve or idle-reclaim threshold) + "
                    f"{margin_mb} MiB margin (DSEC_WARM_POOL_AUTO_MARGIN_MB)")
        return None

    def _warm_args(self, t: PoolTarget) -> ContainerArgs:
        # memory_mb 256: the agent's retained-output bound and /dev/shm are then those of any
        # request of 256 MiB or more (claim.py); limits are the claimer's from the claim on
        return ContainerArgs(image=t.image, cpu_cores=WARM_CPU_CORES, memory_mb=WARM_MEMORY_MB,
                             ttl_idle_s=MAX_TTL_S, labels={WARM_LABEL: t.image})

    async def _warm_prepared(self, t: PoolTarget) -> tuple[Backend, Prepared, Hashable | None]:
        backend = self._backend("container")
        prepared = await backend.prepare(self._warm_args(t), self.stacks)
        key = backend.warm_key(prepared) if isinstance(backend, WarmClaim) else None
        return backend, prepared, key

    async def _warm_key_of(self, t: PoolTarget) -> Hashable | None:
        return (await self._warm_prepared(t))[2]

    async def _warm_start(self, t: PoolTarget) -> WarmSandbox:
        """Start one idle pool sandbox: prepared, admitted and counted like any other (as the
        node's own), no record (a cache: orphans after a crash, destroyed at the next start)."""
        backend, prepared, key = await self._warm_prepared(t)
        if key is None:
            raise InvalidArgument(f"image {t.image!r} cannot have a warm pool on node {self.node_id}",
                                  field=WARM_ENV, fix="use a container image")
        args = prepared.args
        self.admission.admit(await self._node_status(), args.cpu_cores, args.memory_mb)
        now = time.time()
        rec = SandboxRecord(id=make_sandbox_id(self.node_id), project=WARM_PROJECT, backend=args.backend,
                            state=SandboxState.running, args=args, image=args.image,
                            image_digest=prepared.image_digest, uid=prepared.uid, gid=prepared.gid,
                            created_at=now, last_active_at=now)
        self._load.update(rec, live=True)
        try:
            await backend.create(rec.id, prepared, self.stacks)
            agent = await backend.wait_agent(rec.id)
        except BaseException:
            self._load.update(rec, live=False)
            await asyncio.shield(backend.destroy(rec.id))
            raise
        # DSEC_WARM_POOL_RECLAIM: push a waiting one's memory to zram (~1 MiB: the agent) at the cost of
        # its first command faulting it back in; off by default: the pool is for that command's latency
        if self.conf.edge.warm_pool_reclaim and isinstance(backend, Reclaim):
            try:
                await backend.reclaim(rec.id)
            except DsecError as e:
                log.debug("could not reclaim a warm sandbox's memory", extra={"sandbox": rec.id, "error": e.message})
        log.info("warm sandbox ready", extra={"sandbox": rec.id, "image": t.image})
        return WarmSandbox(rec=rec, key=key, backend=backend, agent=agent)

    async def _warm_drop(self, w: WarmSandbox) -> None:
        self._load.update(w.rec, live=False)
        await w.agent.close()
        await w.backend.destroy(w.id)

    async def warm_pools(self) -> dict[str, Any]:
        """The node's warm pools: per image its size, idle and starting sandboxes, last error."""
        return self._pools.status()

    async def set_warm_pools(self, spec: str | None, auto: int | None = None) -> dict[str, Any]:
        """Reconfigure the pools ('image:size,...'; '' for none; None: as they are) and the bound
        on automatic pools (None: as it is; 0: off); refilled or drained in the background."""
        if spec is not None:
            self._pools.set_targets(parse_targets(spec, field="pools"))
        if auto is not None:
            if not 0 <= auto <= MAX_SIZE:
                raise InvalidArgument(f"auto: {auto} is outside 0..{MAX_SIZE}", field="auto",
                                      fix="give how many sandboxes the node may keep warm on its own (0: none)")
            self._pools.set_auto_max(auto)
        return self._pools.status()
