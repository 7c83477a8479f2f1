"""Creates with an idempotency key, once across the cluster (D38).

The key is claimed in the shared control store (store/idempotency.py) before anything is placed.
A retry that finds the claim bound returns that sandbox from its node, wherever the retry
landed; one that finds it still being made waits for it (up to DSEC_IDEMPOTENT_WAIT_S, then a
409 saying to retry): a client retries to get its sandbox, so the answer it wants is the
sandbox, not a second protocol of retries. A first attempt that fails frees the key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from dsec.apiserver.context import ApiContext
from dsec.apiserver.index import keeper
from dsec.store.batch import batcher
from dsec.types import Conflict, SandboxInfo

POLL_S = (0.05, 0.5)        # first and longest wait between looks at a pending claim


async def once(ctx: ApiContext, project: str, key: str,
               create: Callable[[Callable[[str], None]], Awaitable[SandboxInfo]]) -> SandboxInfo:
    """create(bind) makes the sandbox; it may call bind(sandbox_id) inside its own control-store
    transaction (the quota's activation: one commit for both, D97), else it is bound here."""
    claims = keeper(ctx).claims
    writes = batcher(claims.db)       # a burst's claims and binds share transactions (D97)
    deadline = time.monotonic() + ctx.settings.server.idempotent_wait_s
    pause = POLL_S[0]
    while True:
        c = await writes.call(claims.claim, project, key)
        while not c.mine and c.sandbox_id is None and c.token:      # being made by another call
            if time.monotonic() > deadline:
                raise Conflict(f"a create with idempotency_key {key!r} is still in progress", field="idempotency_key",
                               fix="retry the same request in a few seconds: it returns that sandbox once made")
            await asyncio.sleep(pause)
            pause = min(pause * 2, POLL_S[1])
            got = await asyncio.to_thread(claims.get, project, key)
            if got is None:          # its create failed and freed the key: claim it
                break
            c = got
        if c.mine:
            bound: list[str] = []
            token = c.token

            def bind(sandbox_id: str, token: str = token, bound: list[str] = bound) -> None:
                # runs in the store's thread, inside the quota activation's transaction
                claims.bind(project, key, token, sandbox_id)
                bound.append(sandbox_id)
            try:
                info = await create(bind)
            except BaseException:       # a no-op if the bind committed (release wants it unbound)
                await asyncio.shield(writes.call(claims.release, project, key, c.token))
                raise
            if info.id not in bound:
                await asyncio.shield(writes.call(claims.bind, project, key, c.token, info.id))
            return info
        if c.sandbox_id is not None:
            return await ctx.edge_for(c.sandbox_id).get(c.sandbox_id)
