"""Admin routes of a node's warm pools (dsec.edge.warm_pool, D28).

    GET /v1/nodes/{node}/warm-pool   the pools: per image its size, idle and starting sandboxes
    PUT /v1/nodes/{node}/warm-pool   {"pools": "debian-python:8,busybox:4"} ('' for none): the
                                     node refills or drains them in the background;
                                     {"auto": N}: the bound on the node's automatic pools (0: off;
                                     D99); either may be left out (unchanged)

The answer shows the operator's pools under `pools` and the node's automatic ones apart, under
`auto` (each with the burst that made it).

Only keys of the root project (admins): the pools' containers are the node's, and their size
is the node's capacity spent ahead of demand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from dsec.apiserver.deps import Who, admin_only
from dsec.iam import Principal
from dsec.types import NotFound

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext, EdgeHandle


class WarmPoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pools: str | None = Field(None, max_length=4096,
                              description="comma-separated image:size, e.g. 'debian-python:8,busybox:4'; "
                                          "left out: unchanged")
    auto: int | None = Field(None, ge=0, le=1024, description="how many sandboxes the node may keep warm on its "
                             "own, for the burst shapes it sees (0: none); left out: unchanged")


def add_warm_pool_routes(app: FastAPI, ctx: "ApiContext") -> None:
    def edge_of(node: str, who: Principal) -> "EdgeHandle":
        admin_only(ctx, who, "see or set a node's warm pools", "node", fix="ask an admin")
        edge = ctx.edges.get(node)
        if edge is None:
            raise NotFound(f"no node {node!r}", field="node", fix=f"use one of: {', '.join(ctx.edges)}")
        return edge       # in-process Edge or HttpEdge of a cluster node: both carry the verbs

    @app.get("/v1/nodes/{node}/warm-pool")
    async def get_warm_pool(node: str, who: Who) -> dict[str, Any]:
        return await edge_of(node, who).warm_pools()

    @app.put("/v1/nodes/{node}/warm-pool")
    async def set_warm_pool(node: str, body: WarmPoolConfig, who: Who) -> dict[str, Any]:
        return await edge_of(node, who).set_warm_pools(body.pools, body.auto)
