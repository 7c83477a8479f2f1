"""Cumulative output cap: how many bytes of stdout+stderr a sandbox may deliver over its life.

The per-command cap (`output_cap_bytes`, per stream) bounds one command; an agent that runs
`yes` in a loop of 10,000 commands would still push 10,000 x 2 x cap bytes through the agent,
the edge and the client. `output_total_bytes` bounds the sum. Enforcement is exact without
agent changes: before a command starts, the edge reserves the most it could deliver (the
per-stream cap sent to the agent, twice) from the remaining budget, and settles to what was
really delivered when it ends, so concurrent commands can never overshoot together. Once the
budget is spent, commands still run (the sandbox keeps working, e.g. for file-API graders and
commands whose exit status is all that matters) but deliver no output, and their result says
`output_budget_exhausted`. Delivered bytes are what the agent forwarded (<= the cap), not what
the command wrote and the agent dropped: dropping costs the sandbox's own CPU only.

The used count is the record's own `output_used_bytes` column, written with the activity
flush (every reap interval), so an edge restart keeps it (losing at most one interval).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsec.edge.records import SandboxRecord

DEFAULT_TOTAL = 1 << 30          # 1 GiB over a sandbox's life (ContainerArgs.output_total_bytes)


@dataclass
class Grant:
    """What one command may deliver: `per_stream` goes to the agent as its cap."""

    per_stream: int
    reserved: int
    exhausted: bool           # the budget could not cover the requested cap: report it


def reserve(rec: SandboxRecord, cap: int) -> Grant:
    """Reserve up to 2*cap (two streams) from the sandbox's remaining budget."""
    total = getattr(rec.args, "output_total_bytes", DEFAULT_TOTAL)   # VMs have no field: the default
    left = max(0, total - rec.output_used_bytes)
    per_stream = min(cap, left // 2)
    rec.output_used_bytes += 2 * per_stream
    return Grant(per_stream=per_stream, reserved=2 * per_stream, exhausted=per_stream < cap)


def settle(rec: SandboxRecord, grant: Grant, delivered: int) -> None:
    """Give back what the command did not use of its reservation."""
    rec.output_used_bytes = max(0, rec.output_used_bytes - grant.reserved + min(delivered, grant.reserved))
