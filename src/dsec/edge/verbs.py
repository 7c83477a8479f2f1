"""Verbs only some backends have (capabilities): network policy, layer diffs, the VM console.
"""

from __future__ import annotations

import asyncio
import builtins

from dsec.backends.base import Console, Egress, EgressSecrets, LayerDiff
from dsec.types import (EventType, DEFAULT_SCRUB, Conflict, DsecError, EgressSecret, ImageInfo,
                        NetworkPolicy, NetworkRuleSet, PackDiffRequest, SandboxInfo, SandboxState)
from dsec.edge.core import EdgeCore, log


class CapabilityVerbs(EdgeCore):
    async def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        """Replace a running sandbox's egress policy; new connections see it immediately."""
        live = self._running(sandbox_id)
        egress = self._capability(live.rec, Egress, "set_network")
        kept = getattr(getattr(live.rec.args, "network", None), "egress_proxy", None)
        if policy.egress_proxy is None and kept is not None:   # a tunnel lasts the sandbox's life
            policy = policy.model_copy(update={"egress_proxy": kept})
        async with live.net_lock:
            try:
                await egress.set_network(live.id, policy)
            except FileNotFoundError as e:   # stopped (or died) under us
                raise Conflict(f"sandbox {live.id} is {live.rec.state.value}", field="sandbox_id",
                               fix="create a new sandbox") from e
            live.rec.args = live.rec.args.model_copy(update={"network": policy})
            self.records.set_args(live.id, live.rec.args)
            self._emit(EventType.updated, live.rec, network=policy.model_dump(mode="json"))
        self._touch(live.rec)
        log.info("network policy replaced", extra={"sandbox": live.id, "rules": len(policy.rules)})
        return live.rec.info(self.node_id)

    async def set_rulesets(self, rulesets: dict[str, NetworkRuleSet]) -> int:
        """The operator's named rule sets, from the control store (pushed by the apiserver on
        every change and at its start): each Egress backend keeps them, and every running
        sandbox that turned one on has its policy resolved again, so new connections follow
        the change at once. A rule set that is gone counts as off (the sandbox's own policy still
        names it: it comes back if the operator defines it again). Returns how many sandboxes
        were re-applied."""
        egress = [b for b in self._distinct_backends() if isinstance(b, Egress)]
        for b in egress:
            await asyncio.to_thread(b.set_rulesets, rulesets)
        n = 0
        for live in builtins.list(self._live.values()):
            policy = getattr(live.rec.args, "network", None)
            if live.rec.state != SandboxState.running or not isinstance(policy, NetworkPolicy) or \
                    not any(policy.rulesets.values()):
                continue
            b = self._backend(live.rec.backend)
            if not isinstance(b, Egress):
                continue
            known = b.known_rulesets()
            applied = policy.model_copy(update={"rulesets": {k: v for k, v in policy.rulesets.items() if k in known}})
            async with live.net_lock:
                try:
                    await b.set_network(live.id, applied)
                    n += 1
                except (FileNotFoundError, DsecError) as e:     # stopped under us, or a bad set
                    log.warning("rule sets not re-applied", extra={"sandbox": live.id, "error": str(e)})
        log.info("network rule sets replaced", extra={"rulesets": sorted(rulesets), "sandboxes": n})
        return n

    async def set_egress_secrets(self, sandbox_id: str, rules: builtins.list[EgressSecret]) -> None:
        """Issue 30: the rules the node's egress proxy adds secrets to this sandbox's requests by
        (from the apiserver, never stored on the node: an edge restart forgets them)."""
        live = self._running(sandbox_id)
        cap = self._capability(live.rec, EgressSecrets, "set_egress_secrets")
        async with live.net_lock:
            await cap.set_egress_secrets(live.id, rules)
        log.info("egress secret rules set", extra={"sandbox": live.id, "rules": len(rules)})

    async def revoke_egress_secret(self, secret_id: str) -> int:
        """Drop a secret from every sandbox of this node (the next connection goes without it)."""
        n = sum(b.revoke_egress_secret(secret_id) for b in self._distinct_backends() if isinstance(b, EgressSecrets))
        log.info("egress secret revoked", extra={"secret": secret_id, "sandboxes": n})
        return n

    async def pack_diff(self, sandbox_id: str, req: PackDiffRequest) -> ImageInfo:
        """The sandbox's writable changes (additions, modifications, whiteouts, opaque dirs),
        minus the scrub list, as a new workspace layer stacked on the workspace the sandbox
        started from."""
        live = self._running(sandbox_id)
        diff = self._capability(live.rec, LayerDiff, "pack_diff")
        rec = live.rec
        self._touch(rec)
        workspace = getattr(rec.args, "workspace", None)
        parents = [await self.stacks.resolve(workspace, "workspace")] if workspace else []
        scrub = list(DEFAULT_SCRUB if req.scrub is None else req.scrub)
        rec.in_flight += 1      # not reaped while packing
        try:
            # the node's heavy-work lane (bounded, own threads): creations never queue behind it
            async with self.images.heavy.slot(rec.project), diff.frozen_upper(rec.id) as upper:
                disk_mb = getattr(rec.args, "disk_mb", None)   # a layer is bounded by its sandbox's quota
                info = await self.images.heavy.run(
                    self.images.pack_upper, req.name, upper.path, parents=parents, scrub=scrub,
                    source=f"pack_diff:{rec.id}:base={rec.image_digest}", replace=req.replace, map_id=upper.map_id,
                    below=upper.below,
                    max_bytes=disk_mb << 20 if disk_mb else None, owner=rec.project)
        finally:
            rec.in_flight -= 1
            self._touch(rec)
        self.stacks.forget(req.name)
        log.info("pack_diff", extra={"sandbox": rec.id, "layer": req.name, "digest": info.digest})
        return info

    async def resolve_images(self, refs: builtins.list[tuple[str, str]]) -> builtins.list[ImageInfo]:
        """The image each (field, name) means on this node, owner included, as a create here
        would resolve it (the same cache); NotFound naming the field for a missing one. An
        apiserver without the node's registry checks tenancy with it (control._place)."""
        return [await self.stacks.resolve(name, field) for field, name in refs]

    async def console(self, sandbox_id: str, tail: int = 65536) -> bytes:
        """The end of a sandbox's console log (kept while the record is, failed ones included)."""
        rec = self._record(sandbox_id)
        console = self._capability(rec, Console, "console")
        return await asyncio.to_thread(console.console, rec.id, tail)
