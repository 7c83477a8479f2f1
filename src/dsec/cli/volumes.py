"""`dsec volume create|ls|rm`: named, persistent directories of your project (mounted with
`volumes=[{"name", "path", "read_only"}]` at sandbox creation)."""

from __future__ import annotations

from typing import Annotated

from rich.table import Table
import typer

from dsec.cli.common import _client, _run, console

volume_app = typer.Typer(no_args_is_help=True, help="volumes: persistent directories sandboxes mount")


@volume_app.command("create")
def volume_create(name: str,
                  size_mb: Annotated[int, typer.Option(help="quota, MiB: writes beyond it fail")] = 1024) -> None:
    """Create a volume of your project."""
    async def go() -> None:
        async with _client() as c:
            v = await c.create_volume(name, size_mb=size_mb)
            console.print(f"created volume {v.name} ({v.id}, {v.size_mb} MiB"
                          f"{'' if v.enforced else ', measured at each mount'})")
    _run(go())


@volume_app.command("ls")
def volume_ls(usage: Annotated[bool, typer.Option(help="also measure what each holds")] = False) -> None:
    """List your project's volumes."""
    async def go() -> None:
        async with _client() as c:
            t = Table("name", "id", "size MiB", "used MiB", "created")
            for v in await c.volumes(usage=usage):
                used = f"{v.used_bytes / 2**20:.1f}" if v.used_bytes is not None else "-"
                t.add_row(v.name, v.id, str(v.size_mb), used, v.created_at.isoformat(timespec="seconds"))
            console.print(t)
    _run(go())


@volume_app.command("rm")
def volume_rm(names: list[str]) -> None:
    """Delete volumes and their files (refused while a sandbox mounts one)."""
    async def go() -> None:
        async with _client() as c:
            for n in names:
                await c.delete_volume(n)
                console.print(f"deleted {n}")
    _run(go())
