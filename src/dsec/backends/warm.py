"""Warm pools: a backend capability the edge uses to hand out pre-started sandboxes.

A backend that can start a sandbox before it knows who asks for it, and give it the asker's
settings afterwards, says which of a request's settings are fixed at start (`warm_key`: two
requests with the same key can be served by the same pre-started sandbox) and applies the
rest at claim time (`claim`: limits, network policy). Everything the edge keeps per sandbox
(project, labels, env, TTL, lifetime, output budget) is the edge's record and needs nothing
of the backend. Pool logic lives in dsec.edge.warm_pool (docs/decisions.md, D28).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable

from dsec.backends.base import Prepared


class WarmClaim(ABC):
    """Sandboxes started ahead of their request and claimed by it."""

    @abstractmethod
    def warm_key(self, prepared: Prepared) -> Hashable | None:
        """What of `prepared` cannot change once the sandbox runs (image layers, the agent's
        baked-in settings, quotas fixed at start): a pre-started sandbox whose key equals a
        request's can serve it. None: this request can never be served from a pool."""

    @abstractmethod
    async def claim(self, sandbox_id: str, prepared: Prepared) -> None:
        """Give a pre-started (idle, never used) sandbox the settings of `prepared` that are
        not part of its key: resource limits and network policy. Raise on failure (the edge
        then destroys the sandbox)."""
