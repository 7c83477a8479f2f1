"""The control-plane steps every API front (dsec's own routes, the E2B routes) shares: which
sandboxes and snapshots a caller may reach, creation bounded by the project's policy and quota
and placed on a node, and every other policy decision (commands that loosen something, network
policy changes). Routes decide nothing themselves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from dsec import metrics
from dsec.apiserver import egress_secrets, idempotent, quotas, snapshot_export
from dsec.apiserver.audit import note_target
from dsec.apiserver.fair_creates import FairCreates, create_gate
from dsec.apiserver.context import ApiContext, EdgeHandle
from dsec.apiserver.index import keeper
from dsec.apiserver.node_states import node_states
from dsec.apiserver.tenancy import check_usable, check_usable_on
from dsec.iam import Principal
from dsec.iam.policy import check_create, check_network, check_root, is_root
from dsec.store.sandboxes import SandboxIndex
from dsec.types import (CapacityExceeded, DsecError, ExecRequest, NetworkPolicy, NodeUnreachable, NotFound, SandboxArgs,
                        SandboxInfo, Unavailable, node_of_snapshot)

PLACEMENT_TRIES = 3      # nodes tried in turn when the chosen one refuses at its own final check

log = logging.getLogger("dsec.apiserver")


async def owned(ctx: ApiContext, sandbox_id: str, who: Principal,
                field: str = "sandbox_id") -> tuple[EdgeHandle, SandboxInfo]:
    """The edge and info of a sandbox the caller's project (or an ancestor) owns."""
    edge = ctx.edge_for(sandbox_id)
    info = await edge.get(sandbox_id)
    if not ctx.iam.can_access(who, info.project):
        # same answer as a missing sandbox: ids of other projects are not disclosed
        raise NotFound(f"no sandbox {sandbox_id!r}", field=field, fix="check the id and API key")
    return edge, info


async def owned_edge(ctx: ApiContext, sandbox_id: str, who: Principal) -> EdgeHandle:
    """The edge of a sandbox the caller's project (or an ancestor) owns; others' look missing."""
    return (await owned(ctx, sandbox_id, who))[0]


async def owned_snapshot(ctx: ApiContext, snapshot_id: str, who: Principal, field: str = "snapshot_id") -> EdgeHandle:
    """The edge holding a snapshot the caller's project (or an ancestor) took; others' look missing."""
    node = node_of_snapshot(snapshot_id)
    edge = ctx.edges.get(node)
    missing = NotFound(f"no snapshot {snapshot_id!r}", field=field,
                       fix="use an id returned by Sandbox.snapshot(); list them with `dsec vm snapshot ls`")
    if edge is None:
        if await _known_node(ctx, node):
            raise _node_gone(snapshot_id, node, field)
        raise missing
    try:
        info = await edge.get_snapshot(snapshot_id)
    except NotFound:
        raise missing from None
    except NodeUnreachable:
        raise _node_gone(snapshot_id, node, field) from None
    if not ctx.iam.can_access(who, info.project):
        raise missing          # a snapshot holds a guest's memory: other projects never reach it
    return edge


async def _known_node(ctx: ApiContext, node: str) -> bool:
    """A node the cluster has seen (an operator state or a sandbox in the index), now gone."""
    if node in await node_states(ctx).rows():
        return True
    return bool(await asyncio.to_thread(SandboxIndex(ctx.iam.db).list, None, node=node, limit=1))


def _node_gone(snapshot_id: str, node: str, field: str) -> Unavailable:
    """A snapshot lives on its node alone: while that node does not answer it cannot be read
    or restored (503, the node's fault, not the caller's)."""
    return Unavailable(f"snapshot {snapshot_id} lives on node {node}, which does not answer (its files are "
                       "only there)", field=field,
                       fix=f"restore it when node {node} is back; if it is gone for good, its snapshots went "
                           f"with it: `dsec nodes forget {node}` and snapshot a sandbox on another node")


async def create_sandbox(ctx: ApiContext, who: Principal, args: SandboxArgs,
                         inline_secrets: list | None = None) -> SandboxInfo:
    """Create on the least-loaded node that admits it, bounded by the project's policy and
    its (and every ancestor's) quota; other projects' layers look missing. A restore from a
    snapshot goes to the snapshot's node. Secret rules (egress_secrets.py) reach the edge
    before the caller gets the sandbox."""
    policy = ctx.iam.effective_policy(who.project_id)
    check_create(policy, args, who.project_id)
    gate = create_gate(ctx)           # fair between projects: rate (429), then a round-robin turn
    gate.admit(who.project_id, policy)
    args, rules = egress_secrets.prepare(ctx, who.project_id, args, inline_secrets)
    info = await _create_sandbox(ctx, who, args, gate)
    note_target(info.id)          # the audit log's entry names the new sandbox (audit.py)
    await egress_secrets.push(ctx, info, rules)
    return info


async def _create_sandbox(ctx: ApiContext, who: Principal, args: SandboxArgs, gate: FairCreates) -> SandboxInfo:
    snapshot = getattr(args, "snapshot", None)
    if snapshot:
        edge = await owned_snapshot(ctx, snapshot, who, field="snapshot")
        node = getattr(edge, "node_id", None)
        if (await node_states(ctx).unschedulable()).get(node or "") in ("draining", "forgotten"):
            return await _restore_elsewhere(ctx, who, args, edge, gate)    # VM snapshots: refused, naming why
        try:
            async with gate.turn(who.project_id):
                return await create_on(ctx, edge, who, args)
        except CapacityExceeded as full:       # its node is full: a container snapshot goes elsewhere
            try:
                return await _restore_elsewhere(ctx, who, args, edge, gate)
            except Unavailable:
                raise full from None
    image: str | None = None      # its digest: placement prefers nodes that hold it (D34)
    if ctx.images is not None:
        image = check_usable(ctx.iam, ctx.images, who, args)[0].digest
    async with gate.turn(who.project_id):
        return await _indexed(ctx, who, args, lambda: _place(ctx, who, args, image))


async def _restore_elsewhere(ctx: ApiContext, who: Principal, args: SandboxArgs, edge: EdgeHandle,
                             gate: FairCreates) -> SandboxInfo:
    """A container snapshot whose node takes no new sandbox, created on another node from the
    layer its node packs into the shared layer store (snapshot_export.py)."""
    exp = await edge.export_snapshot(str(getattr(args, "snapshot")))
    moved = snapshot_export.args_from(args, exp)
    check_create(ctx.iam.effective_policy(who.project_id), moved, who.project_id)
    async with gate.turn(who.project_id):
        info = await _indexed(ctx, who, moved, lambda: _place(ctx, who, moved))
    log.info("snapshot restored on another node", extra={"snapshot": exp.snapshot, "sandbox": info.id})
    return info


async def create_on(ctx: ApiContext, edge: EdgeHandle, who: Principal, args: SandboxArgs) -> SandboxInfo:
    """Create on a given edge (a snapshot's node), holding the project's quota for it; not on a
    draining node (a cordoned one still takes restores of its own snapshots)."""
    node = getattr(edge, "node_id", None)
    state = (await node_states(ctx).unschedulable()).get(node or "")
    if state in ("draining", "forgotten"):
        raise Unavailable(f"node {node} is {state}: it takes no new sandboxes", field="snapshot",
                          fix=f"restore elsewhere from another snapshot, or `dsec nodes uncordon {node}`")
    return await _indexed(ctx, who, args, lambda: edge.create(who.project_id, args))


async def _indexed(ctx: ApiContext, who: Principal, args: SandboxArgs,
                   create: Callable[[], Awaitable[SandboxInfo]]) -> SandboxInfo:
    """Run `create` holding the project's quota (quotas.py), once per idempotency key across the
    cluster (idempotent.py), and record the sandbox in the cross-node index (queued: the answer
    does not wait for the write). The key's bind commits with the quota's activation (D97)."""
    key = getattr(args, "idempotency_key", None)
    if key:
        info = await idempotent.once(ctx, who.project_id, key,
                                     lambda bind: quotas.with_quota(ctx, who.project_id, args, create, then=bind))
    else:
        info = await quotas.with_quota(ctx, who.project_id, args, create)
    keeper(ctx).created(info)
    return info


async def set_network(ctx: ApiContext, edge: EdgeHandle, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
    """Replace a running sandbox's egress policy, within its project's policy (the sandbox's
    project, which may be a sub-project of the caller's)."""
    project = (await edge.get(sandbox_id)).project
    check_network(ctx.iam.effective_policy(project), policy, project, prefix="")
    if policy.egress_proxy is not None and policy.egress_proxy.password is not None:   # never stored
        policy = policy.model_copy(update={"egress_proxy": policy.egress_proxy.model_copy(update={"password": None})})
    return await edge.set_network(sandbox_id, policy)


async def stop_sandbox(ctx: ApiContext, edge: EdgeHandle, sandbox_id: str,
                       reason: str | None = None, end: str = "killed") -> SandboxInfo:
    """Stop it, end its index row and give its quota back at once (the index sync and reconcile
    would find it later). `end`: its end reason (killed; preempted when the platform stops it)."""
    info = await (edge.stop(sandbox_id, reason=reason) if end == "killed"
                  else edge.stop(sandbox_id, reason=reason, end=end))
    keeper(ctx).ended(sandbox_id, info.state.value)
    await quotas.ended(ctx, sandbox_id)
    return info


async def _place(ctx: ApiContext, who: Principal, args: SandboxArgs, image: str | None = None) -> SandboxInfo:
    held = await node_states(ctx).unschedulable()     # cordoned, draining, forgotten (`dsec nodes`)
    excluded: set[str] = set(held)
    last: DsecError | None = None
    for _ in range(PLACEMENT_TRIES):
        try:
            node = ctx.placer.choose(ctx.watcher.nodes(), args.backend, args.cpu_cores, args.memory_mb,
                                     exclude=excluded, image=image)
        except DsecError:
            metrics.PLACEMENTS.labels("none_left").inc()
            if last is not None:   # every node refused: the last edge's reason names what is short
                raise last from None
            if held and not set(ctx.edges) - set(held):
                raise Unavailable("every node is " + ", ".join(f"{n} {s}" for n, s in sorted(held.items())),
                                  field="node", fix="`dsec nodes uncordon <node>`, or add nodes") from None
            raise
        try:
            if ctx.images is None:    # no registry of its own (cluster replicas): the node's says the owners
                await check_usable_on(ctx.iam, ctx.edges[node], who, args)
            info = await ctx.edges[node].create(who.project_id, args)
            ctx.placer.landed(node, args.cpu_cores, args.memory_mb, ctx.watcher.interval_s)
            metrics.PLACEMENTS.labels("placed").inc()
            return info
        except CapacityExceeded as e:   # the edge's own final check: place elsewhere
            ctx.placer.release(node, args.cpu_cores, args.memory_mb)
            excluded.add(node)
            last = e
            metrics.PLACEMENTS.labels("retried").inc()
        except NodeUnreachable as e:
            ctx.placer.release(node, args.cpu_cores, args.memory_mb)
            if e.delivered:         # it may exist there: a second one elsewhere would be a duplicate
                raise
            log.warning("node unreachable at create, placing elsewhere", extra={"node": node})
            excluded.add(node)      # gone since the watcher's last poll: the next node
            last = e
            metrics.PLACEMENTS.labels("retried").inc()
        except Unavailable as e:    # a fault of the node (its lazy layer view, ...): the next node
            ctx.placer.release(node, args.cpu_cores, args.memory_mb)
            log.warning("node fault at create, placing elsewhere", extra={"node": node, "error": e.message[:200]})
            excluded.add(node)
            last = _on_node(node, e)
            metrics.PLACEMENTS.labels("retried").inc()
        except BaseException:
            ctx.placer.release(node, args.cpu_cores, args.memory_mb)
            raise
    assert last is not None
    raise last


def _on_node(node: str, e: Unavailable) -> Unavailable:
    """The node's fault, naming the node (503: never the caller's error)."""
    if f"node {node}" in e.message:
        return e
    out = Unavailable(f"node {node}: {e.message}", field=e.field, fix=e.fix)
    if getattr(e, "retry_after_s", None):
        out.retry_after_s = e.retry_after_s   # type: ignore[attr-defined]
    return out


def loosens(req: ExecRequest) -> bool:
    """The command asks for more than a sandbox's default (root, a larger output cap)."""
    return is_root(req.user) or req.output_cap_bytes is not None


def check_exec_in(ctx: ApiContext, project: str, req: ExecRequest) -> None:
    """Per-command loosening is bounded by the project's policy, like create."""
    if loosens(req):
        check_create(ctx.iam.effective_policy(project), req, project)


def check_file_user_in(ctx: ApiContext, project: str, user: str | None) -> None:
    """A file call as root is bounded by the project's policy (allow_root), as a root command is."""
    if is_root(user):
        check_root(ctx.iam.effective_policy(project), user, project, what="file calls")


async def check_file_user(ctx: ApiContext, edge: EdgeHandle, sandbox_id: str, user: str | None) -> None:
    """check_file_user_in, the project looked up only for root (plain calls cost no IAM query)."""
    if is_root(user):
        check_file_user_in(ctx, (await edge.get(sandbox_id)).project, user)


async def check_exec(ctx: ApiContext, edge: EdgeHandle, sandbox_id: str, req: ExecRequest) -> None:
    """check_exec_in, the sandbox's project looked up only when the command loosens something,
    so plain execs cost no IAM query."""
    if loosens(req):
        check_exec_in(ctx, (await edge.get(sandbox_id)).project, req)
