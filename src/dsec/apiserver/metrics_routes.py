"""Metrics and usage: Prometheus text for operators (and a project's own series), and a
sandbox's usage samples (sb.metrics(), `dsec sandbox top`).

    GET /metrics                   admin: this process's metrics (embedded: apiserver + the node)
    GET /v1/metrics                any key: this process's series of the caller's project
    GET /v1/nodes/{node}/metrics   admin: that node's edge's metrics (cluster: discover nodes
                                   with GET /v1/nodes); a project key: its own series there
    GET /v1/sandboxes/{id}/metrics the sandbox's usage samples (?start=&end=, Unix seconds)

Each answer is one process's exposition, so no family is repeated across nodes; a
Prometheus scrapes each node through the apiserver (docs/metrics.md).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from dsec import metrics
from dsec.apiserver.deps import Ctx, Who, admin_only, is_admin, owned
from dsec.types import NotFound, UsageList

router = APIRouter()

Since = Annotated[float | None, Query(ge=0, description="Unix seconds: samples at or after it")]
Until = Annotated[float | None, Query(ge=0, description="Unix seconds: samples at or before it")]


def _text(body: str) -> Response:
    return Response(body, media_type=metrics.CONTENT_TYPE)


@router.get("/metrics", response_class=Response)
async def node_metrics(who: Who, ctx: Ctx) -> Response:
    """Admin only: every metric of this process, Prometheus text format."""
    admin_only(ctx, who, "read the node-wide metrics", "Authorization",
               fix="use an admin key, or GET /v1/metrics for your project's own series")
    return _text(metrics.exposition())


@router.get("/v1/metrics", response_class=Response)
async def project_metrics(who: Who, ctx: Ctx) -> Response:
    """The caller's project's own series (creations, execs, sandboxes by state)."""
    return _text(metrics.exposition(who.project_id))


@router.get("/v1/nodes/{node}/metrics", response_class=Response)
async def one_node_metrics(node: str, who: Who, ctx: Ctx) -> Response:
    edge = ctx.edges.get(node)
    if edge is None:
        raise NotFound(f"no node {node!r}", field="node", fix="list nodes with GET /v1/nodes")
    return _text(await edge.metrics_text(None if is_admin(ctx, who) else who.project_id))


@router.get("/v1/sandboxes/{sandbox_id}/metrics", response_model=UsageList)
async def sandbox_usage(sandbox_id: str, who: Who, ctx: Ctx, start: Since = None, end: Until = None) -> UsageList:
    """The sandbox's CPU, memory, disk and network samples, oldest first: every 5 s while
    someone asked within the last minute, else every 60 s; up to 720 kept."""
    edge = await owned(ctx, sandbox_id, who)
    return UsageList(sandbox_id=sandbox_id, samples=await edge.usage(sandbox_id, start, end))
