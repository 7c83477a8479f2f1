"""Listing and bulk verbs across nodes that survive a dead node (D38).

Every node is asked at once, each within a deadline (fanout.py). A node that does not answer,
and a node discovery has dropped whose sandboxes the index still holds (it may come back), is
served from the sandbox index: its sandboxes with their last known state, the node named in
`unreachable_nodes`. Bulk verbs act on the nodes that answer and report the others' matching
sandboxes as items with an error naming the node; the call itself never fails for a node.
"""

from __future__ import annotations

import asyncio
from dsec.apiserver.context import ApiContext
from dsec.apiserver.fanout import fan_out
from dsec.apiserver.index import IndexKeeper, from_index, keeper
from dsec.iam import Principal
from dsec.store.sandboxes import IndexedSandbox
from dsec.types import BulkItem, BulkResult, SandboxInfo, SandboxList, SandboxState

ENDED = (SandboxState.stopped, SandboxState.failed)


async def _away(ctx: ApiContext, k: IndexKeeper, failed: dict[str, str],
                include_ended: bool) -> dict[str, list[IndexedSandbox]]:
    """Indexed sandboxes of the nodes that did not answer and of nodes no longer discovered."""
    await k.flush()          # this apiserver's latest creates and stops first

    def read() -> dict[str, list[IndexedSandbox]]:
        nodes = set(failed) | (k.index.live_nodes() - set(ctx.edges))
        return {n: k.index.list(None, node=n, include_ended=include_ended) for n in sorted(nodes)}
    return await asyncio.to_thread(read)


async def list_sandboxes(ctx: ApiContext, who: Principal, include_ended: bool = False) -> SandboxList:
    """The caller's sandboxes on every node (those of unreachable nodes as last indexed)."""
    k = keeper(ctx)
    answers, failed, listed_at = await fan_out(ctx.edges, include_ended, ctx.settings.server.list_node_deadline_s)
    out: list[SandboxInfo] = []
    for node, infos in answers.items():
        k.listed(node, [i for i in infos if i.state not in ENDED], listed_at)   # keeps the index true
        out += [s for s in infos if ctx.iam.can_access(who, s.project)]
    unreachable = set(failed)
    for node, rows in (await _away(ctx, k, failed, include_ended)).items():
        for r in rows:
            info = from_index(r) if ctx.iam.can_access(who, r.project_id) else None
            if info is not None:
                out.append(info)
                unreachable.add(node)
    return SandboxList(sandboxes=out, unreachable_nodes=sorted(unreachable))


async def bulk(ctx: ApiContext, who: Principal, labels: dict[str, str], verb: str) -> BulkResult:
    """`verb` (suspend_many, resume_many) on the caller's sandboxes with all these labels, on
    every node that answers; the others' matching sandboxes come back with an error."""
    def match(project: str, have: dict[str, str]) -> bool:
        return ctx.iam.can_access(who, project) and all(have.get(k) == v for k, v in labels.items())

    k = keeper(ctx)
    answers, failed, _ = await fan_out(ctx.edges, False, ctx.settings.server.list_node_deadline_s)

    async def act(node: str, ids: list[str]) -> list[BulkItem]:
        try:
            items: list[BulkItem] = await getattr(ctx.edges[node], verb)(ids)
            return items
        except Exception as e:   # the node went away between listing and acting: only its items fail
            return [BulkItem(id=i, error=f"node {node} did not answer: {type(e).__name__}: {e}") for i in ids]

    jobs = {node: [s.id for s in infos if match(s.project, s.labels)] for node, infos in answers.items()}
    done = await asyncio.gather(*(act(node, ids) for node, ids in jobs.items() if ids))
    out = [item for items in done for item in items]
    for node, rows in (await _away(ctx, k, failed, False)).items():
        why = failed.get(node, "it left the cluster")
        out += [BulkItem(id=r.id, error=f"node {node} is unreachable ({why}); retry when it is back")
                for r in rows if match(r.project_id, r.labels)]
    return BulkResult(sandboxes=out)
