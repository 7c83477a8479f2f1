"""Project quotas at the apiserver: reserve before a sandbox is placed, bind the reservation
to the sandbox once an edge created it, give it back when the sandbox ends (iam/quota.py holds
the ledger).

Sandboxes that end without the apiserver seeing it (TTL and idle reaps, a failed sandbox, a
stop through another front) are found by reconcile(): reservations bound before a moment are
compared with every edge's list of live sandboxes taken after it; those missing are released.
It runs when a creation is about to be refused (so a refusal is never caused by a sandbox that
has already gone) and when a quota is read, at most every RECONCILE_MIN_S per apiserver.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dsec import metrics
from dsec.apiserver.context import ApiContext
from dsec.apiserver.fanout import fan_out
from dsec.iam import QuotaExceeded
from dsec.store.batch import batcher
from dsec.types import SandboxInfo, node_of

log = logging.getLogger("dsec.apiserver.quotas")

RECONCILE_MIN_S = 0.5


async def reserve(ctx: ApiContext, project: str, args: Any) -> str:
    """A reservation of one sandbox of `args`' size for the project and its ancestors, or
    QuotaExceeded naming the project and the limit (after a reconcile found nothing to free)."""
    try:
        return await batcher(ctx.iam.db).call(ctx.iam.quotas.reserve, project, args.cpu_cores, args.memory_mb)
    except QuotaExceeded:
        refused_at = time.time()
        if not await reconcile(ctx, since=refused_at):
            raise
    return await asyncio.to_thread(ctx.iam.quotas.reserve, project, args.cpu_cores, args.memory_mb)


async def with_quota(ctx: ApiContext, project: str, args: Any,
                     create: Callable[[], Awaitable[SandboxInfo]],
                     then: Callable[[str], object] | None = None) -> SandboxInfo:
    """Run `create` holding the project's quota for it; a failed creation gives it back. `then`
    (the idempotency key's bind) runs with the activation, in its transaction (D97)."""
    try:
        rid = await reserve(ctx, project, args)
    except QuotaExceeded:
        metrics.REFUSED.labels("quota").inc()
        raise
    try:
        info = await create()
    except BaseException:
        await asyncio.shield(batcher(ctx.iam.db).call(lambda: ctx.iam.quotas.release(reservation_id=rid)))
        raise

    def activate() -> None:
        ctx.iam.quotas.activate(rid, info.id)
        if then is not None:
            then(info.id)
    await asyncio.shield(batcher(ctx.iam.db).call(activate))
    return info


async def ended(ctx: ApiContext, sandbox_id: str) -> None:
    """The sandbox ended (stopped through this apiserver): its quota is free again."""
    await batcher(ctx.iam.db).call(lambda: ctx.iam.quotas.release(sandbox_id=sandbox_id))


async def reconcile(ctx: ApiContext, since: float = 0.0) -> bool:
    """Release reservations of sandboxes no edge has any more. True if that may have freed
    quota since `since` (a reconcile ran after it: worth trying again)."""
    async with ctx.runtime.reconcile_lock:
        last = ctx.runtime.reconciled_at
        if last >= since and since:
            return True                       # another caller reconciled after our refusal
        if time.time() - last < RECONCILE_MIN_S:
            return False
        t0 = time.time()
        ctx.runtime.reconciled_at = t0
        held = await asyncio.to_thread(ctx.iam.quotas.held, t0)
        # every node at once, each within the listing deadline (fanout.py, D38); a node that
        # did not answer keeps its sandboxes' quota
        answers, _failed, _ = await fan_out(dict(ctx.edges), False, ctx.settings.server.list_node_deadline_s)
        live = {s.id for infos in answers.values() for s in infos}
        listed = set(answers)
        gone = [h for h in held if h.sandbox_id not in live and _node(h.sandbox_id) in listed]
        freed = 0
        for h in gone:
            freed += await asyncio.to_thread(ctx.iam.quotas.release, reservation_id=h.reservation_id)
        freed += await asyncio.to_thread(ctx.iam.quotas.release_stale_pending)
        if freed:
            log.info("quota reconcile released sandboxes that ended unseen", extra={"released": freed})
        return freed > 0


def _node(sandbox_id: str) -> str | None:
    try:
        return node_of(sandbox_id)
    except Exception:
        return None
