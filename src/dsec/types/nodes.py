"""Nodes (the watcher/placement view of an edge)."""

from __future__ import annotations


from pydantic import (BaseModel)


class NodeCapacity(BaseModel):
    cpu_cores: float        # ceilings on committed limits: the node's share x the overcommit ratios
    memory_mb: int
    max_sandboxes: int
    # the edge's share of its host when not all of it (its cgroup's limits, DSEC_NODE_SHARE,
    # DSEC_NODE_CPU_CORES / DSEC_NODE_MEMORY_MB: edge/node_share.py); None: the whole host
    node_cpu_cores: float | None = None
    node_memory_mb: int | None = None


class NodeStatus(BaseModel):
    node_id: str
    healthy: bool
    backends: list[str]
    capacity: NodeCapacity
    committed_cpu_cores: float = 0.0
    committed_memory_mb: int = 0
    sandboxes: int = 0
    reason: str | None = None
    pressure: float = 0.0   # highest PSI avg10 / its admission limit: 0 idle, >= 1 the edge refuses
    # short keys (dsec.placement.locality.image_key) of images the node holds locally, most
    # recently used at most 256: placement prefers these nodes while load allows (D34)
    cached_images: frozenset[str] = frozenset()
    # what an operator set (`dsec nodes`): active, cordoned, draining; a node gone from the
    # cluster but not forgotten is listed unhealthy with `missing_since` (epoch seconds)
    state: str = "active"
    missing_since: float | None = None

    @property
    def load(self) -> float:
        """Fraction of the tightest resource already committed."""
        c = self.capacity
        return max(self.committed_memory_mb / max(c.memory_mb, 1),
                   self.committed_cpu_cores / max(c.cpu_cores, 1e-9),
                   self.sandboxes / max(c.max_sandboxes, 1))


class WarmPool(BaseModel):
    """One image's warm pool on a node (edge/warm_pool.py, D28)."""
    size: int                  # the target: idle sandboxes the node keeps started
    idle: int = 0              # started, waiting for a create to claim them
    starting: int = 0          # being started now
    error: str | None = None   # the last failed start's error (cleared by the next that succeeds)
    burst: int | None = None   # automatic pools: the largest burst of its shape that set it (D99)

    @property
    def full(self) -> bool:
        """Every one of `size` started and waiting, none starting."""
        return self.idle >= self.size and self.starting == 0


class WarmPools(BaseModel):
    """A node's warm pools (GET/PUT /v1/nodes/{node}/warm-pool): per image, the operator's
    (`pools`) and those the node keeps on its own for the burst shapes it sees (`auto`, at most
    `auto_max` sandboxes in all; D99), and the creates they answered (`claims`) or that matched a
    pool but found it empty (`misses`)."""
    pools: dict[str, WarmPool] = {}
    auto: dict[str, WarmPool] = {}
    auto_max: int = 0             # DSEC_WARM_POOL_AUTO (0: the node keeps none on its own)
    auto_idle_s: float | None = None   # an automatic pool ends after this long without a burst
    auto_off_s: float = 0.0       # seconds before automatic pools may be made again (after a drop)
    auto_dropped: str | None = None   # why automatic pools were last dropped (a create refused or waiting)
    claims: int = 0
    misses: int = 0
