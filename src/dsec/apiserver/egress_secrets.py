"""Secrets added at the egress proxy (issue 30), the apiserver's part: the project's store,
resolving a create's `secrets` into rules for the sandbox's edge, revocation on every node.

A sandbox names the secrets it may use (`secrets=[...]`, or E2B's `network.rules` transforms,
kept for that sandbox only). The values go from the store to the sandbox's edge only (the
edge keeps them in memory for its egress proxy); the sandbox gets paths to the trust bundle
in its environment, never a value.
"""

from __future__ import annotations

import asyncio
import logging

from dsec.apiserver.context import ApiContext
from dsec.iam.secrets import SecretStore
from dsec.security.egress_ca import trust_env
from dsec.types import E2B_INLINE_MARK, EgressSecret, InvalidArgument, SandboxArgs, SandboxInfo

log = logging.getLogger("dsec.apiserver.egress_secrets")

REVOKE_TIMEOUT_S = 5.0


def store(ctx: ApiContext) -> SecretStore:
    if ctx.runtime.secrets is None:
        key = ctx.settings.server.secrets_key_file or ctx.iam.home / "secrets.key"
        ctx.runtime.secrets = SecretStore(ctx.iam.db, key)
    return ctx.runtime.secrets


def prepare(ctx: ApiContext, project: str, args: SandboxArgs,
            inline: list[EgressSecret] | None = None) -> tuple[SandboxArgs, list[EgressSecret]]:
    """The args with the trust variables added, and the rules to push once the sandbox exists
    (InvalidArgument naming `secrets[i]` for a name the project lacks: before anything exists)."""
    args, socks = _socks_credentials(args)
    names = list(getattr(args, "secrets", None) or [])
    if not names:
        return args, socks
    if socks or getattr(getattr(args, "network", None), "egress_proxy", None) is not None:
        raise InvalidArgument("secrets are added by the node's egress proxy on connections it makes itself; "
                              "with an egress_proxy every connection goes through the SOCKS5 proxy instead",
                              field="network.egress_proxy", fix="use either secrets (or E2B rules) or an egress proxy")
    if args.backend != "container":
        raise InvalidArgument("secrets are added by the node's egress proxy, which serves container sandboxes",
                              field="secrets", fix="use a container sandbox, or leave secrets empty")
    stored = [n for n in names if n != E2B_INLINE_MARK]
    rules = store(ctx).rules(project, stored) + list(inline or [])
    env = {**trust_env(), **args.env}
    return args.model_copy(update={"env": env}), rules


def _socks_credentials(args: SandboxArgs) -> tuple[SandboxArgs, list[EgressSecret]]:
    """NetworkPolicy.egress_proxy's password out of the args (which are stored and returned):
    the edge gets the credentials in memory, like secret rules; the address stays in the policy,
    so the sandbox is tunnelled from its first packet whatever happens to the push."""
    net = getattr(args, "network", None)
    proxy = getattr(net, "egress_proxy", None)
    if proxy is None or proxy.username is None:
        return args, []
    rule = EgressSecret(id="socks5", hosts=[], ports=[], headers={}, kind="socks5",
                        auth=[proxy.username, proxy.password or ""])
    stripped = net.model_copy(update={"egress_proxy": proxy.model_copy(update={"password": None})})
    return args.model_copy(update={"network": stripped}), [rule]


async def push(ctx: ApiContext, info: SandboxInfo, rules: list[EgressSecret]) -> None:
    """Give the sandbox's edge its rules; a sandbox that cannot get them is stopped (it was
    created to use them) and the error returned."""
    if not rules:
        return
    edge = ctx.edge_for(info.id)
    inline = [r.model_copy(update={"id": f"e2b:{info.id}"}) if r.kind == "inline" else r for r in rules]
    try:
        await edge.set_egress_secrets(info.id, inline)
    except BaseException:
        try:
            await edge.stop(info.id, reason="its egress secrets could not be set")
        except Exception:
            log.warning("could not stop a sandbox whose secrets were not set", extra={"sandbox": info.id})
        raise


async def revoke(ctx: ApiContext, secret_id: str) -> None:
    """Tell every node to drop it (the edges keep rules in memory; one that does not answer now
    forgets them when it restarts, and it is logged)."""
    async def one(node: str) -> None:
        try:
            await asyncio.wait_for(ctx.edges[node].revoke_egress_secret(secret_id), REVOKE_TIMEOUT_S)
        except Exception as e:
            log.warning("node did not confirm a secret revocation", extra={"node": node, "secret": secret_id,
                                                                           "error": str(e)[:200]})
    await asyncio.gather(*(one(n) for n in list(ctx.edges)))



