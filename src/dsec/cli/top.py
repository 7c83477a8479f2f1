"""`dsec sandbox top`: the caller's running sandboxes' usage as a live table (rich), from
each sandbox's usage samples (GET /v1/sandboxes/{id}/metrics); `--once` prints it once."""

from __future__ import annotations

import asyncio
from typing import Annotated, Optional

import typer
from rich.live import Live
from rich.table import Table

from dsec.cli.common import _client, _run, console
from dsec.cli.sandboxes import sandbox_app
from dsec.types import DsecError, SandboxState, UsageSample

MAX_ROWS = 50          # the busiest this many (a terminal shows no more)
PARALLEL = 16          # metrics requests in flight per refresh


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def _net(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**10:.0f}K"


def table(rows: list[tuple[str, UsageSample | None]]) -> Table:
    t = Table("id", "cpu %", "cpus", "mem MiB", "mem limit", "cache MiB", "disk MiB", "disk limit", "net rx", "net tx",
              title="dsec sandbox top")
    for sid, s in rows:
        if s is None:
            t.add_row(sid, *["-"] * 9)
            continue
        t.add_row(sid, f"{s.cpu_used_pct:.1f}", str(s.cpu_count), _mib(s.mem_used), _mib(s.mem_total),
                  _mib(s.mem_cache), _mib(s.disk_used), _mib(s.disk_total), _net(s.net_rx_bytes), _net(s.net_tx_bytes))
    return t


async def _rows(c, ids: list[str] | None) -> list[tuple[str, UsageSample | None]]:   # type: ignore[no-untyped-def]
    if not ids:
        listed = await c.listing()
        ids = [s.id for s in listed.sandboxes if s.state == SandboxState.running]
    gate = asyncio.Semaphore(PARALLEL)

    async def latest(sid: str) -> tuple[str, UsageSample | None]:
        async with gate:
            try:
                samples = await (await c.get(sid)).metrics()
            except DsecError:        # stopped since the listing
                return sid, None
            return sid, samples[-1] if samples else None

    rows = await asyncio.gather(*(latest(sid) for sid in ids))
    rows.sort(key=lambda r: -(r[1].cpu_used_pct if r[1] else -1))
    return list(rows[:MAX_ROWS])


@sandbox_app.command("top")
def sandbox_top(sandbox_ids: Annotated[Optional[list[str]], typer.Argument(help="these only (default: all running)")] = None,
                once: Annotated[bool, typer.Option("--once", help="print the table once and exit")] = False,
                interval: Annotated[float, typer.Option(min=1.0, help="seconds between refreshes")] = 5.0) -> None:
    """Live CPU, memory, disk and network of your running sandboxes (the busiest first)."""
    async def go() -> None:
        async with _client() as c:
            if once:
                console.print(table(await _rows(c, sandbox_ids)))
                return
            with Live(table([]), console=console, refresh_per_second=1) as live:
                while True:
                    live.update(table(await _rows(c, sandbox_ids)))
                    await asyncio.sleep(interval)
    try:
        _run(go())
    except KeyboardInterrupt:
        pass
