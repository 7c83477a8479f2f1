"""What the node's sandboxes hold, kept as running totals.

Admission and the watcher ask for the node's committed CPU and memory on every creation and
poll; summing over every live sandbox made each creation O(n) (3,200 sandboxes: the sum ran on
every create). The edge reports each sandbox's change of state here instead, so a status is
O(1). CPU is counted in millicores: float sums drift over millions of updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsec.edge.records import SandboxRecord
from dsec.types import SandboxState

# a sandbox holds CPU and memory while it is live and neither parked nor going away
NOT_HOLDING = frozenset({SandboxState.stopping, SandboxState.suspended, SandboxState.stopped, SandboxState.failed})


@dataclass
class NodeLoad:
    _held: dict[str, tuple[int, int]] = field(default_factory=dict)   # id -> (millicores, MiB)
    _millicores: int = 0
    _memory_mb: int = 0

    def update(self, rec: SandboxRecord, live: bool) -> None:
        """Call after the sandbox's state (or its being live on this edge) changed."""
        old = self._held.pop(rec.id, None)
        if old is not None:
            self._millicores -= old[0]
            self._memory_mb -= old[1]
        if live and rec.state not in NOT_HOLDING:
            held = (round(rec.cpu_cores * 1000), rec.memory_mb)
            self._held[rec.id] = held
            self._millicores += held[0]
            self._memory_mb += held[1]

    @property
    def sandboxes(self) -> int:
        return len(self._held)

    @property
    def cpu_cores(self) -> float:
        return self._millicores / 1000

    @property
    def memory_mb(self) -> int:
        return self._memory_mb
