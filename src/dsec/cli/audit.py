"""`dsec audit`: who (which key) created, changed, stopped or read what (apiserver/audit.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Optional

from rich.markup import escape
from rich.table import Table
import typer

from dsec.cli.common import _client, _run, console


def audit(project: Annotated[Optional[str], typer.Option(help="only this project")] = None,
          key: Annotated[Optional[str], typer.Option(help="only what this key id did")] = None,
          action: Annotated[Optional[str], typer.Option(help="exact (exec.start) or a prefix ending in a dot "
                                                             "(file.)")] = None,
          target: Annotated[Optional[str], typer.Option(help="only entries about this sandbox, key, ...")] = None,
          since: Annotated[Optional[datetime], typer.Option(help="from this time (ISO 8601)")] = None,
          limit: Annotated[int, typer.Option(help="at most this many, newest first")] = 50,
          before: Annotated[Optional[str], typer.Option(help="the next page: the id printed last time")] = None,
          as_json: Annotated[bool, typer.Option("--json", help="JSON lines")] = False) -> None:
    """The audit log (an admin key: its project's and those below it), newest first."""
    async def go() -> None:
        async with _client() as c:
            page = await c.audit(project=project, key_id=key, action=action, target=target, since=since,
                                 before=before, limit=limit)
            if as_json:
                for e in page.entries:
                    print(e.model_dump_json(), flush=True)
                return
            t = Table("at", "project", "key", "action", "target", "status", "details")
            for e in page.entries:
                t.add_row(e.at.isoformat(timespec="seconds"), e.project, e.key_id, e.action, escape(e.target),
                          str(e.status), escape(" ".join(f"{k}={v}" for k, v in e.details.items())))
            console.print(t)
            if page.next_before:
                console.print(f"more: --before {page.next_before}")
    _run(go())
