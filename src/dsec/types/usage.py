"""Per-sandbox usage samples (what `sb.metrics()`, `dsec sandbox top` and E2B's metrics
routes return): one sample is the sandbox's CPU, memory, disk and network at one moment."""

from __future__ import annotations

from pydantic import BaseModel, Field


class UsageSample(BaseModel):
    timestamp: float = Field(description="when it was sampled (Unix seconds)")
    cpu_count: int = Field(description="CPU cores the sandbox may use (its cpu_cores, rounded up)")
    cpu_used_pct: float = Field(description="CPU used since the previous sample, percent of cpu_count cores")
    mem_used: int = Field(description="bytes of memory in use, page cache excluded")
    mem_cache: int = Field(description="bytes of page cache charged to the sandbox")
    mem_total: int = Field(description="the sandbox's memory limit in bytes")
    disk_used: int = Field(description="bytes in the sandbox's writable layer")
    disk_total: int = Field(description="the sandbox's disk limit in bytes")
    net_rx_bytes: int | None = Field(None, description="bytes the sandbox received so far (None: no network device)")
    net_tx_bytes: int | None = Field(None, description="bytes the sandbox sent so far (None: no network device)")


class UsageList(BaseModel):
    sandbox_id: str
    samples: list[UsageSample]
