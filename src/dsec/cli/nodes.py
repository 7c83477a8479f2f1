"""`dsec nodes ...`: the cluster's nodes, and the operator verbs on them (apiserver/node_admin.py)."""

from __future__ import annotations

import datetime
from typing import Annotated

import typer
from rich.table import Table

from dsec.cli.common import _client, _run, console

nodes_app = typer.Typer(no_args_is_help=True,
                        help="nodes: list; cordon / drain / uncordon; forget a node gone for good (admin)")

Node = Annotated[str, typer.Argument(help="a node id, as `dsec nodes ls` shows it")]


@nodes_app.command("ls")
def nodes_ls() -> None:
    """Every node: health, operator state, sandboxes, committed resources."""
    async def go() -> None:
        async with _client() as c:
            nodes = await c.nodes()
        t = Table("node", "state", "healthy", "sandboxes", "cpu", "memory MiB", "note")
        for n in sorted(nodes, key=lambda n: n.node_id):
            note = n.reason or ""
            if n.missing_since is not None:
                since = datetime.datetime.fromtimestamp(n.missing_since, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
                note = f"gone since {since}; {note}"
            t.add_row(n.node_id, n.state, "yes" if n.healthy else "no", str(n.sandboxes),
                      f"{n.committed_cpu_cores:g}/{n.capacity.cpu_cores:g}",
                      f"{n.committed_memory_mb}/{n.capacity.memory_mb}", note)
        console.print(t)
    _run(go())


def _verb(action: str, node: str, stop: bool = False) -> None:
    async def go() -> None:
        async with _client() as c:
            console.print_json(data=await c.node_action(node, action, stop=stop))
    _run(go())


@nodes_app.command("cordon")
def nodes_cordon(node: Node) -> None:
    """No new placement on the node (its sandboxes keep running; restores of its snapshots still go there)."""
    _verb("cordon", node)


@nodes_app.command("drain")
def nodes_drain(node: Node, stop: Annotated[bool, typer.Option(
        "--stop", help="also stop its sandboxes now; each ends `preempted` (infrastructure)")] = False) -> None:
    """No new sandbox on the node at all; lists the sandboxes it still holds (nothing is moved),
    or with --stop stops them."""
    _verb("drain", node, stop=stop)


@nodes_app.command("uncordon")
def nodes_uncordon(node: Node) -> None:
    """Make a cordoned or draining node take new sandboxes again."""
    _verb("uncordon", node)


@nodes_app.command("forget")
def nodes_forget(node: Node) -> None:
    """A node gone for good: release its sandboxes' quota and index rows (refused while it answers)."""
    _verb("forget", node)
