"""`dsec sandbox ...` and `dsec run`: create, exec into, list and remove sandboxes."""

from __future__ import annotations

import math
import shlex
import sys
from typing import Annotated, Optional

from rich.table import Table
import typer

from dsec.cli.common import _client, _run, console, err_console
from dsec.types import ContainerArgs, DsecError, MicroVMArgs, VMArgs


sandbox_app = typer.Typer(no_args_is_help=True, help="create, exec into, list and remove sandboxes")

Backend = Annotated[str, typer.Option(help="container, microvm (QEMU microvm) or vm (QEMU q35)")]

def _args(backend: str, image: str, cpu: float, memory_mb: int, ttl_idle_s: int, user: Optional[str],
          disk: Optional[str] = None):
    """CLI flags -> the backend's own argument type (VMs count whole vCPUs)."""
    if backend == "container":
        return ContainerArgs(image=image, cpu_cores=cpu, memory_mb=memory_mb, ttl_idle_s=ttl_idle_s, user=user)
    cls = {"microvm": MicroVMArgs, "vm": VMArgs}.get(backend)
    if cls is None:
        raise DsecError(f"unknown backend {backend!r}", field="backend", fix="use container, microvm or vm")
    if disk is not None and backend != "vm":
        raise DsecError("--disk boots a full VM", field="disk", fix="add --backend vm")
    extra = {"disk": disk} if disk is not None else {}
    return cls(image=image, vcpus=max(1, math.ceil(cpu)), memory_mb=max(128, memory_mb), ttl_idle_s=ttl_idle_s,
               user=user, **extra)


@sandbox_app.command("create")
def sandbox_create(image: str, cpu: float = 1.0, memory_mb: int = 512, ttl_idle_s: int = 600,
                   user: Optional[str] = None, backend: Backend = "container",
                   disk: Annotated[Optional[str], typer.Option(help="vm: boot this disk (dsec vm disk build)")] = None
                   ) -> None:
    async def go() -> None:
        async with _client() as c:
            sb = await c.create(_args(backend, image, cpu, memory_mb, ttl_idle_s, user, disk))
            console.print(sb.id)
    _run(go())


@sandbox_app.command("suspend")
def sandbox_suspend(sandbox_id: str) -> None:
    """Park a VM sandbox on disk (memory freed); its next request resumes it."""
    async def go() -> None:
        async with _client() as c:
            console.print((await (await c.get(sandbox_id)).suspend()).state.value)
    _run(go())


@sandbox_app.command("snapshot")
def sandbox_snapshot(sandbox_id: str) -> None:
    """Save a running sandbox (VMs: memory too; containers: the filesystem); create new sandboxes
    from it with its snapshot id."""
    async def go() -> None:
        async with _client() as c:
            snap = await (await c.get(sandbox_id)).snapshot()
            console.print(f"{snap.id}  ({snap.size_bytes / 2**20:.1f} MiB)")
    _run(go())


@sandbox_app.command("fork")
def sandbox_fork(sandbox_id: str, count: int = 1) -> None:
    """Branch a running sandbox into COUNT new ones (its files copy-on-write); one line each."""
    async def go() -> None:
        async with _client() as c:
            forked = await (await c.get(sandbox_id)).fork(count)
            for f in forked.forks:
                console.print(f.sandbox.id if f.sandbox is not None else f"error: {f.error}")
            for n in forked.not_carried:
                console.print(f"not carried: {n}")
    _run(go())


@sandbox_app.command("console")
def sandbox_console(sandbox_id: str, tail: int = 65536) -> None:
    """Print the end of a VM's serial console."""
    async def go() -> None:
        async with _client() as c:
            sys.stdout.write(await (await c.get(sandbox_id)).console(tail))
    _run(go())


async def _stream_to_terminal(sb, cmd: str, session: Optional[str], timeout_s: float) -> int:
    code = 1
    async for ev in sb.stream(cmd, session=session, timeout_s=timeout_s):
        if ev.type == "stdout":
            sys.stdout.write(ev.data)
            sys.stdout.flush()
        elif ev.type == "stderr":
            sys.stderr.write(ev.data)
            sys.stderr.flush()
        elif ev.type == "exit" and ev.result:
            r = ev.result
            if r.truncated:
                err_console.print(f"[yellow]output truncated[/yellow]: {r.stdout_bytes} stdout / {r.stderr_bytes} stderr bytes produced")
            if r.timed_out:
                err_console.print("[yellow]timed out[/yellow]")
            code = r.exit_code if r.exit_code is not None else 128 + (r.signal or 0)
    return code


def command_line(argv: list[str]) -> str:
    """The shell line for CMD: one argument is a shell command line as it is (`-- 'ls | wc'`);
    several are an argv, each quoted so it arrives intact (`-- python3 -c 'print(6*7)'`)."""
    return argv[0] if len(argv) == 1 else shlex.join(argv)


@sandbox_app.command("exec", context_settings={"allow_extra_args": True})
def sandbox_exec(sandbox_id: str, cmd: Annotated[list[str], typer.Argument(help="command (after --)")],
                 session: Optional[str] = None, timeout_s: float = 300.0) -> None:
    async def go() -> int:
        async with _client() as c:
            return await _stream_to_terminal(await c.get(sandbox_id), command_line(cmd), session, timeout_s)
    raise typer.Exit(_run(go()))


@sandbox_app.command("ls")
def sandbox_ls(all: Annotated[bool, typer.Option("--all", help="include stopped and failed")] = False) -> None:
    async def go() -> None:
        async with _client() as c:
            t = Table("id", "state", "image", "cpu", "mem MiB", "created", "error")
            listed = await c.listing(include_ended=all)
            for s in listed.sandboxes:
                t.add_row(s.id, s.state.value, s.image, f"{s.cpu_cores:g}", str(s.memory_mb),
                          s.created_at.isoformat(timespec="seconds"), s.error or "")
            console.print(t)
            if listed.unreachable_nodes:     # their sandboxes are shown as last known
                typer.echo(f"warning: node(s) {', '.join(listed.unreachable_nodes)} did not answer: their "
                           "sandboxes are shown with their last known state", err=True)
    _run(go())


@sandbox_app.command("rm")
def sandbox_rm(sandbox_ids: list[str]) -> None:
    async def go() -> None:
        async with _client() as c:
            for sid in sandbox_ids:
                await (await c.get(sid)).stop()
                console.print(f"stopped {sid}")
    _run(go())


def run(image: str, cmd: Annotated[list[str], typer.Argument(help="command (after --)")],
        cpu: float = 1.0, memory_mb: int = 512, timeout_s: float = 300.0, user: Optional[str] = None,
        backend: Backend = "container") -> None:
    """Create a sandbox from IMAGE, run CMD in it (output streamed), then remove it."""
    async def go() -> int:
        async with _client() as c:
            sb = await c.create(_args(backend, image, cpu, memory_mb, 600, user))
            try:
                return await _stream_to_terminal(sb, command_line(cmd), None, timeout_s)
            finally:
                await sb.stop()
    raise typer.Exit(_run(go()))
