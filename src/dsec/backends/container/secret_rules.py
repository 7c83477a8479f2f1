"""The secret rules of this node's sandboxes (issue 30), as the apiserver pushed them: in
memory only (an edge restart forgets them: requests then go out without the secret, never
elsewhere with it). Read by the egress proxy per connection, so a revocation counts for the
next connection at once."""

from __future__ import annotations

from dsec.types import EgressSecret
from dsec.types.domains import matches


class SecretRules:
    def __init__(self) -> None:
        self._by_sandbox: dict[str, list[EgressSecret]] = {}

    def set(self, sandbox_id: str, rules: list[EgressSecret]) -> None:
        self._by_sandbox[sandbox_id] = list(rules)

    def drop(self, sandbox_id: str) -> None:
        self._by_sandbox.pop(sandbox_id, None)

    def revoke(self, secret_id: str) -> int:
        """Remove the rule from every sandbox; how many held it."""
        n = 0
        for sid, rules in list(self._by_sandbox.items()):
            kept = [r for r in rules if r.id != secret_id]
            n += len(rules) - len(kept)
            self._by_sandbox[sid] = kept
        return n

    def has(self, sandbox_id: str) -> bool:
        """Whether the sandbox was given rules (its TCP 443 then goes to the proxy)."""
        return sandbox_id in self._by_sandbox

    def tunnel_auth(self, sandbox_id: str) -> tuple[str, str] | None:
        """The RFC 1929 credentials of the sandbox's SOCKS5 egress proxy, if it was given any."""
        for r in self._by_sandbox.get(sandbox_id, ()):
            if r.kind == "socks5" and r.auth and len(r.auth) == 2:
                return r.auth[0], r.auth[1]
        return None

    def ports(self, sandbox_id: str) -> set[int]:
        return {p for r in self._by_sandbox.get(sandbox_id, ()) for p in r.ports}

    def match(self, sandbox_id: str, host: str, port: int) -> EgressSecret | None:
        """The rule for this destination (names compared whole, as domain rules are): an exact
        name wins, then the longest wildcard, then the first given (E2B's precedence; rules
        are not merged)."""
        best: tuple[int, EgressSecret] | None = None
        for r in self._by_sandbox.get(sandbox_id, ()):
            if port not in r.ports:
                continue
            for h in r.hosts:
                if matches(host, (h,)):
                    rank = 1 << 16 if not h.startswith("*.") else len(h)
                    if best is None or rank > best[0]:
                        best = (rank, r)
        return best[1] if best else None
