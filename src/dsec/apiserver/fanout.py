"""Asking every node at once for its sandboxes, each within a deadline (D38): one node that
died (and that discovery has not dropped yet) costs a listing at most NODE_DEADLINE_S and is
named, instead of failing the listing for everybody."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from dsec.apiserver.context import EdgeHandle
from dsec.types import SandboxInfo

log = logging.getLogger("dsec.apiserver.fanout")


async def _one(edge: EdgeHandle, include_ended: bool, deadline_s: float) -> list[SandboxInfo]:
    return await asyncio.wait_for(edge.list(None, include_ended), deadline_s)


async def fan_out(edges: Mapping[str, EdgeHandle], include_ended: bool = False, deadline: float = 3.0
                  ) -> tuple[dict[str, list[SandboxInfo]], dict[str, str], float]:
    """(node -> its sandboxes, node -> why it did not answer within `deadline` s
    (DSEC_LIST_NODE_DEADLINE_S), when the nodes were asked)."""
    listed_at = time.time()
    nodes = list(edges.items())
    results = await asyncio.gather(*(_one(edge, include_ended, deadline) for _, edge in nodes),
                                   return_exceptions=True)
    answers: dict[str, list[SandboxInfo]] = {}
    failed: dict[str, str] = {}
    for (node, _), r in zip(nodes, results):
        if isinstance(r, BaseException):
            if isinstance(r, asyncio.CancelledError):
                raise r
            why = f"no answer within {deadline:g} s" if isinstance(r, TimeoutError) else f"{type(r).__name__}: {r}"
            failed[node] = why
            log.warning("node did not answer a listing", extra={"node": node, "error": why})
        else:
            answers[node] = r
    return answers, failed, listed_at
