"""What every command group of the CLI shares: its consoles, error output, settings and client."""

from __future__ import annotations

import asyncio
import functools
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
import typer

from dsec.types import DsecError


if TYPE_CHECKING:
    from dsec.settings import Settings

console = Console(width=None if sys.stdout.isatty() else 200)  # pipes get whole ids
err_console = Console(stderr=True, soft_wrap=not sys.stderr.isatty())   # logs and pipes get whole lines


def _fail(e: DsecError) -> None:
    # escape(): messages may hold brackets ("dsec-sandbox[server]", "toolkits[0]") that are not markup
    err_console.print(f"[red]error[/red]: {escape(e.message)}" + (f"\n  field: {escape(e.field)}" if e.field else "")
                      + (f"\n  fix: {escape(e.fix)}" if e.fix else ""))
    raise typer.Exit(2)


@functools.cache
def _settings() -> "Settings":
    """This command's settings: the environment, read once, for the server-side commands (client
    commands leave DSEC_URL and DSEC_API_KEY to the SDK); a bad value fails with its fix."""
    from dsec.settings import Settings
    try:
        return Settings.from_env()
    except DsecError as e:
        _fail(e)
        raise


def _run(coro):
    try:
        return asyncio.run(coro)
    except DsecError as e:
        _fail(e)


def _client():
    from dsec.sdk.client import Client
    return Client()
