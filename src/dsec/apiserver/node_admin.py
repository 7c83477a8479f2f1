"""Operator verbs on nodes (`dsec nodes`), kept in the control store (store/nodes.py) so that
every replica honours them:

    POST /v1/nodes/{node}/cordon     no new placement there (restores of its snapshots still go there)
    POST /v1/nodes/{node}/drain      no new sandbox there at all; answers the sandboxes it still
                                     holds (nothing is moved: they end by themselves or are stopped)
                                     ?stop=true: and stops them, each ending `preempted` (the
                                     platform took the capacity back: infrastructure, a trainer masks it)
    POST /v1/nodes/{node}/uncordon   active again
    POST /v1/nodes/{node}/forget     a node gone for good: its sandboxes leave the index (`forgotten`)
                                     and their quota is released; refused while the node answers.
                                     Should it come back, the index keeper stops what it still runs
                                     (their quota is gone) and makes it active again

Admins only (keys of the root project). Replicas read the states at most every STATES_TTL_S
(node_states.py), so a cordon reaches every replica's placement within that.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI
from pydantic import BaseModel

from dsec.apiserver.control import stop_sandbox
from dsec.apiserver.deps import Who, admin_only
from dsec.apiserver.fanout import fan_out
from dsec.apiserver.node_states import node_states
from dsec.store.sandboxes import SandboxIndex
from dsec.types import Conflict, DsecError, NODE_ID_RE, InvalidArgument, NotFound, SandboxState, Unavailable

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext

log = logging.getLogger("dsec.apiserver.node_admin")
PREEMPT_PARALLEL = 8      # stops at a time on a drained node (each tears down a sandbox)

class NodeAdminResult(BaseModel):
    node_id: str
    state: str                      # active, cordoned, draining; forgotten after forget
    sandboxes: list[str] = []       # drain: the ones it still holds (as it or the index answers)
    released: int = 0               # forget: quota reservations given back
    ended: int = 0                  # forget: index rows ended
    stopped: list[str] = []         # drain?stop=true: the ones stopped (ended `preempted`)


def _check(node: str) -> str:
    if not NODE_ID_RE.match(node):
        raise InvalidArgument(f"{node!r} is not a node name", field="node", fix="use a node id from `dsec nodes ls`")
    return node


async def _remaining(ctx: "ApiContext", node: str) -> list[str]:
    """The node's live sandboxes: its own answer, else the index's."""
    edge = ctx.edges.get(node)
    if edge is not None:
        answers, _, _ = await fan_out({node: edge}, False, ctx.settings.server.list_node_deadline_s)
        if node in answers:
            return sorted(s.id for s in answers[node])
    rows = await asyncio.to_thread(SandboxIndex(ctx.iam.db).list, None, node=node)
    return sorted(r.id for r in rows)


def add_node_admin_routes(app: FastAPI, ctx: "ApiContext") -> None:
    async def set_state(node: str, state: str, who: Who) -> NodeAdminResult:
        admin_only(ctx, who, "cordon, drain or uncordon nodes", "node", fix="ask an admin")
        _check(node)
        states = node_states(ctx)
        known = node in ctx.edges or node in await states.rows()
        if not known:
            raise NotFound(f"no node {node!r}", field="node", fix=f"use one of: {', '.join(sorted(ctx.edges))}")
        await asyncio.to_thread(states.registry.set_state, node, state)
        states.invalidate()
        log.info("node state set", extra={"node": node, "state": state})
        return NodeAdminResult(node_id=node, state=state,
                               sandboxes=await _remaining(ctx, node) if state == "draining" else [])

    @app.post("/v1/nodes/{node}/cordon", response_model=NodeAdminResult)
    async def cordon(node: str, who: Who) -> NodeAdminResult:
        return await set_state(node, "cordoned", who)

    @app.post("/v1/nodes/{node}/drain", response_model=NodeAdminResult)
    async def drain(node: str, who: Who, stop: bool = False) -> NodeAdminResult:
        result = await set_state(node, "draining", who)
        if stop:
            result.stopped = await _preempt(node, result.sandboxes)
            result.sandboxes = sorted(set(result.sandboxes) - set(result.stopped))
        return result

    async def _preempt(node: str, ids: list[str]) -> list[str]:
        """Stop the drained node's sandboxes as `preempted` (a few at a time); one already gone
        is skipped, the others' errors leave them in the answer's `sandboxes`."""
        edge = ctx.edges.get(node)
        if edge is None:
            raise Unavailable(f"node {node!r} does not answer: its sandboxes cannot be stopped", field="node",
                              fix="drain it without stop, or forget it once it is gone (`dsec nodes forget`)")
        gate = asyncio.Semaphore(PREEMPT_PARALLEL)

        async def one(sid: str) -> str | None:
            async with gate:
                try:
                    info = await stop_sandbox(ctx, edge, sid, reason=f"its node {node} was drained "
                                              "(dsec nodes drain --stop)", end="preempted")
                except DsecError as e:
                    log.warning("drain could not stop a sandbox", extra={"sandbox": sid, "error": e.message})
                    return None
                return sid if info.state == SandboxState.stopped and info.end_reason == "preempted" else None
        done = await asyncio.gather(*(one(s) for s in ids))
        log.warning("node drained with stop", extra={"node": node, "stopped": sum(1 for d in done if d)})
        return sorted(d for d in done if d)

    @app.post("/v1/nodes/{node}/uncordon", response_model=NodeAdminResult)
    async def uncordon(node: str, who: Who) -> NodeAdminResult:
        return await set_state(node, "active", who)

    @app.post("/v1/nodes/{node}/forget", response_model=NodeAdminResult)
    async def forget(node: str, who: Who) -> NodeAdminResult:
        admin_only(ctx, who, "forget nodes", "node", fix="ask an admin")
        _check(node)
        if node in ctx.edges:
            raise Conflict(f"node {node!r} is still part of the cluster", field="node",
                           fix=f"drain it (`dsec nodes drain {node}`), stop its sandboxes, then stop its raylet "
                               "for good; forget it once it is gone")
        states = node_states(ctx)
        index = SandboxIndex(ctx.iam.db)
        known = node in await states.rows() or await asyncio.to_thread(index.list, None, node=node, limit=1)
        if not known:
            raise NotFound(f"no node {node!r} is known", field="node", fix="list nodes with `dsec nodes ls`")
        released = await asyncio.to_thread(ctx.iam.quotas.release_node, node)
        ended = await asyncio.to_thread(index.end_node, node, "forgotten")
        await asyncio.to_thread(states.registry.set_state, node, "forgotten")
        states.invalidate()
        log.warning("node forgotten", extra={"node": node, "released": released, "ended": ended})
        return NodeAdminResult(node_id=node, state="forgotten", released=released, ended=ended)
