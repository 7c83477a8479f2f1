"""`dsec volume create|ls|rm`: named, persistent directories of your project (mounted with
`volumes=[{"name", "path", "read_only"}]` at sandbox creation)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

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


def _volume_path(arg: str) -> tuple[str, str] | None:
    """NAME:/path -> (NAME, /path); a local path -> None."""
    name, sep, path = arg.partition(":")
    if not sep or "/" in name or not name:
        return None
    return name, path or "/"


@volume_app.command("cp")
def volume_cp(src: str, dst: str,
              mode: Annotated[Optional[int], typer.Option(help="permission bits of a file written, e.g. 0o644 "
                                                              "as 420")] = None) -> None:
    """Copy one file in or out of a volume without a sandbox: `dsec volume cp ./f data:/dir/f`,
    `dsec volume cp data:/dir/f ./f` (`-` for stdin/stdout). No link in the volume is followed."""
    s, d = _volume_path(src), _volume_path(dst)
    if (s is None) == (d is None):
        raise typer.BadParameter("one side must be VOLUME:/path and the other a local path (or -)")

    async def go() -> None:
        async with _client() as c:
            if d is not None:
                data = sys.stdin.buffer.read() if src == "-" else Path(src).read_bytes()
                e = await c.volume_write(d[0], d[1], data, mode=mode)
                console.print(f"wrote {e.size} bytes to {d[0]}:{e.path}")
            else:
                assert s is not None
                data = await c.volume_read(s[0], s[1])
                if dst == "-":
                    sys.stdout.buffer.write(data)
                    sys.stdout.flush()
                else:
                    Path(dst).write_bytes(data)
    _run(go())


@volume_app.command("files")
def volume_files(target: Annotated[str, typer.Argument(help="VOLUME or VOLUME:/dir")],
                 depth: Annotated[int, typer.Option(help="levels below the directory")] = 1) -> None:
    """List the files of a volume (links shown, not followed)."""
    name, _, path = target.partition(":")

    async def go() -> None:
        async with _client() as c:
            t = Table("type", "mode", "uid:gid", "bytes", "path")
            for e in await c.volume_ls(name, path or "/", depth):
                shown = f"{e.path} -> {e.target}" if e.target is not None else e.path
                t.add_row(e.type, f"{e.mode:o}", f"{e.uid}:{e.gid}", str(e.size), shown)
            console.print(t)
    _run(go())


@volume_app.command("rm-file")
def volume_rm_file(target: Annotated[str, typer.Argument(help="VOLUME:/path")]) -> None:
    """Remove a file, link or directory (with what it holds) from a volume."""
    got = _volume_path(target)
    if got is None or got[1] in ("", "/"):
        raise typer.BadParameter("name what to remove: VOLUME:/path")

    async def go() -> None:
        async with _client() as c:
            await c.volume_remove(*got)
            console.print(f"removed {target}")
    _run(go())
