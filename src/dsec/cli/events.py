"""`dsec webhook add|ls|rm|deliveries` and `dsec events`: lifecycle events (docs/events.md)."""

from __future__ import annotations

from typing import Annotated, Optional

from rich.markup import escape
from rich.table import Table
import typer

from dsec.cli.common import _client, _run, console

webhook_app = typer.Typer(no_args_is_help=True, help="webhooks: POST this project's lifecycle events to a URL, signed")


@webhook_app.command("add")
def webhook_add(url: str,
                events: Annotated[Optional[str], typer.Option(help="comma-separated types (created, paused, "
                                                                   "resumed, updated, ended); default all")] = None,
                secret: Annotated[Optional[str], typer.Option(help="HMAC key (16+ chars); default: made and "
                                                                   "printed once")] = None,
                name: Annotated[str, typer.Option()] = "",
                project: Annotated[Optional[str], typer.Option(help="admin: another project's events")] = None) -> None:
    """Register a webhook; prints its id and signing secret (shown only now)."""
    async def go() -> None:
        async with _client() as c:
            h = await c.add_webhook(url, events=events.split(",") if events else None, secret=secret, name=name,
                                    project=project)
            console.print(f"{h.id}\tsecret: {escape(h.secret or '')}")
    _run(go())


@webhook_app.command("ls")
def webhook_ls() -> None:
    """Your project's webhooks (an admin key: all), with their delivery counts."""
    async def go() -> None:
        async with _client() as c:
            t = Table("id", "project", "url", "events", "pending", "delivered", "failed")
            for h in await c.webhooks():
                d = await c.webhook_deliveries(h.id, limit=1)
                t.add_row(h.id, h.project, escape(h.url), ",".join(h.events) if h.events else "all",
                          str(d.pending), str(d.delivered), str(d.failed))
            console.print(t)
    _run(go())


@webhook_app.command("rm")
def webhook_rm(webhook_id: str) -> None:
    """Remove a webhook and its queued deliveries."""
    async def go() -> None:
        async with _client() as c:
            await c.remove_webhook(webhook_id)
    _run(go())


@webhook_app.command("deliveries")
def webhook_deliveries(webhook_id: str, limit: Annotated[int, typer.Option()] = 20) -> None:
    """A webhook's latest deliveries: status, attempts, the receiver's last answer."""
    async def go() -> None:
        async with _client() as c:
            d = await c.webhook_deliveries(webhook_id, limit)
            t = Table("event", "status", "attempts", "last status", "last error")
            for x in d.deliveries:
                t.add_row(str(x.event_id), x.status, str(x.attempts), str(x.last_status or ""),
                          escape(x.last_error or ""))
            console.print(t)
            console.print(f"pending {d.pending}, delivered {d.delivered}, failed {d.failed}")
    _run(go())


def events(after: Annotated[int, typer.Option(help="only events after this id")] = 0,
           sandbox: Annotated[Optional[str], typer.Option(help="one sandbox's")] = None,
           follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new events")] = False) -> None:
    """Lifecycle events as JSON lines (created, paused, resumed, updated, ended with a reason)."""
    async def go() -> None:
        async with _client() as c:
            if follow:
                async for e in c.follow_events(after, sandbox_id=sandbox):
                    print(e.model_dump_json(), flush=True)
                return
            page = await c.events(after, sandbox_id=sandbox)
            for e in page.events:
                print(e.model_dump_json())
    _run(go())
