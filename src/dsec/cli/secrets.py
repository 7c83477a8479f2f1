"""`dsec secret ...`: credentials the node's egress proxy adds to sandboxes' requests (issue 30).
The value is read from stdin or an environment variable, never from the command line (which
other users of the machine and shell histories see), and never printed back."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

from rich.table import Table
import typer

from dsec.cli.common import _client, _fail, _run, console
from dsec.types import InvalidArgument

secret_app = typer.Typer(no_args_is_help=True, help="secrets added at the egress proxy: create, list, remove")


@secret_app.command("create")
def secret_create(name: str,
                  host: Annotated[list[str], typer.Option(help="destination name (repeat); `*.example.com` "
                                                                "covers the names below")],
                  header: Annotated[Optional[str], typer.Option(help="header the value is put in, e.g. "
                                                                     "Authorization (value 'Bearer ...')")] = None,
                  basic_auth: Annotated[bool, typer.Option(help="add the value (user:password) as basic "
                                                                "auth")] = False,
                  port: Annotated[Optional[list[int]], typer.Option(help="destination port (default 443)")] = None,
                  value_env: Annotated[Optional[str], typer.Option(help="read the value from this environment "
                                                                        "variable (default: stdin)")] = None) -> None:
    """Store a secret; sandboxes created with `secrets=[NAME]` get it added on the way out."""
    if value_env:
        value = os.environ.get(value_env, "")
        if not value:
            _fail(InvalidArgument(f"environment variable {value_env} is empty or unset", field="--value-env",
                                  fix="export it, or pipe the value on stdin"))
    else:
        value = sys.stdin.readline().rstrip("\r\n")
    async def go() -> None:
        async with _client() as c:
            info = await c.create_secret(name, value, host, header=header, basic_auth=basic_auth, ports=port)
            console.print(info["name"])
    _run(go())


@secret_app.command("ls")
def secret_ls() -> None:
    """Your project's secrets: names and destinations (never values)."""
    async def go() -> None:
        async with _client() as c:
            t = Table("name", "hosts", "ports", "added as")
            for s in await c.list_secrets():
                t.add_row(s["name"], ", ".join(s["hosts"]), ", ".join(map(str, s["ports"])),
                          "basic auth" if s["basic_auth"] else f"header {s['header']}")
            console.print(t)
    _run(go())


@secret_app.command("rm")
def secret_rm(name: str) -> None:
    """Remove a secret; every node stops adding it before this returns."""
    async def go() -> None:
        async with _client() as c:
            await c.delete_secret(name)
            console.print(name)
    _run(go())
