"""Operators' named network rule sets: the admin API, and the push to every edge.

    GET    /v1/network/rulesets          every rule set (any key: projects use them by name)
    PUT    /v1/network/rulesets/{name}   define or replace one (a key of the root project)
    DELETE /v1/network/rulesets/{name}   remove one (root); sandboxes that turned it on lose it

The control store (iam/rulesets.py) holds them; after each change the whole set goes to every
edge (EdgeHandle.set_rulesets), which keeps it in DSEC_HOME/network-rulesets.json and resolves
the policies of its running sandboxes again, so new connections follow the change when the
call returns. At the apiserver's start the set is pushed again (a node that was down for a
change catches up); with an empty store nothing is pushed, so a node file written by hand
before the store existed stays in force until the first change through the API.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from fastapi import APIRouter, Body
from pydantic import BaseModel

from dsec.apiserver.context import ApiContext
from dsec.apiserver.deps import Ctx, Who, admin_only
from dsec.iam.rulesets import check_name
from dsec.types import DsecError, NetworkRuleSet

log = logging.getLogger("dsec.apiserver.rulesets")

router = APIRouter()
PUSH_TIMEOUT_S = 30.0
_FIX = "ask an operator (a key of the root project) to change rule sets"


class NodePush(BaseModel):
    ok: bool
    sandboxes: int = 0          # running sandboxes whose policy was resolved again
    error: str | None = None


class RulesetsAnswer(BaseModel):
    rulesets: dict[str, NetworkRuleSet]
    nodes: dict[str, NodePush] = {}


async def push(ctx: ApiContext) -> dict[str, NodePush]:
    """Send the store's rule sets to every edge, concurrently; a node that fails is reported
    (it catches up at the next change or apiserver start)."""
    sets = await asyncio.to_thread(ctx.iam.rulesets.all)

    async def one(node: str) -> NodePush:
        try:
            n = await asyncio.wait_for(ctx.edges[node].set_rulesets(sets), PUSH_TIMEOUT_S)
            return NodePush(ok=True, sandboxes=n)
        except (DsecError, OSError, asyncio.TimeoutError) as e:
            log.warning("rule sets not pushed to a node", extra={"node": node, "error": str(e)})
            return NodePush(ok=False, error=str(e) or type(e).__name__)
    nodes = list(ctx.edges)
    return dict(zip(nodes, await asyncio.gather(*(one(n) for n in nodes))))


async def push_at_start(ctx: ApiContext) -> None:
    try:
        if await asyncio.to_thread(ctx.iam.rulesets.all):
            await push(ctx)
    except DsecError as e:      # the store unreachable at start: the nodes keep what they had
        log.warning("rule sets not pushed at start", extra={"error": str(e)})


@router.get("/v1/network/rulesets", response_model=RulesetsAnswer)
async def list_rulesets(who: Who, ctx: Ctx) -> RulesetsAnswer:
    return RulesetsAnswer(rulesets=await asyncio.to_thread(ctx.iam.rulesets.all))


@router.put("/v1/network/rulesets/{name}", response_model=RulesetsAnswer)
async def put_ruleset(name: str, body: Annotated[NetworkRuleSet, Body()], who: Who, ctx: Ctx) -> RulesetsAnswer:
    """Define or replace a rule set; running sandboxes that use it follow for new connections."""
    admin_only(ctx, who, "define network rule sets", field="name", fix=_FIX)
    check_name(name)
    await asyncio.to_thread(ctx.iam.rulesets.put, name, body)
    nodes = await push(ctx)
    return RulesetsAnswer(rulesets=await asyncio.to_thread(ctx.iam.rulesets.all), nodes=nodes)


@router.delete("/v1/network/rulesets/{name}", response_model=RulesetsAnswer)
async def delete_ruleset(name: str, who: Who, ctx: Ctx) -> RulesetsAnswer:
    admin_only(ctx, who, "remove network rule sets", field="name", fix=_FIX)
    await asyncio.to_thread(ctx.iam.rulesets.delete, name)
    nodes = await push(ctx)
    return RulesetsAnswer(rulesets=await asyncio.to_thread(ctx.iam.rulesets.all), nodes=nodes)
