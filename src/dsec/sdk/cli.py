"""`dsec` command line: serve, images, sandboxes, one-shot runs, benchmarks."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from dsec.config import DEFAULT_PORT, Paths
from dsec.types import ContainerArgs, DsecError

app = typer.Typer(no_args_is_help=True, help="dsec: elastic sandboxes for agent training and evaluation")
image_app = typer.Typer(no_args_is_help=True, help="build, list and remove images")
sandbox_app = typer.Typer(no_args_is_help=True, help="create, exec into, list and remove sandboxes")
bench_app = typer.Typer(no_args_is_help=True, help="benchmarks, side by side with baselines")
app.add_typer(image_app, name="image")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(bench_app, name="bench")
console = Console(width=None if sys.stdout.isatty() else 200)  # pipes get whole ids
err_console = Console(stderr=True)


def _fail(e: DsecError) -> None:
    err_console.print(f"[red]error[/red]: {e.message}" + (f"\n  field: {e.field}" if e.field else "")
                      + (f"\n  fix: {e.fix}" if e.fix else ""))
    raise typer.Exit(2)


def _run(coro):
    try:
        return asyncio.run(coro)
    except DsecError as e:
        _fail(e)


# -- server ----------------------------------------------------------------------------------
@app.command()
def up(host: str = "127.0.0.1", port: int = DEFAULT_PORT, node_id: str = "local",
       background: Annotated[bool, typer.Option(help="start in the background and return when ready")] = False,
       log_level: str = "INFO") -> None:
    """Serve the apiserver with one embedded edge (the single-machine default)."""
    if background:
        from dsec.sdk.client import Client
        os.environ.setdefault("DSEC_URL", f"http://{host}:{port}")

        async def wait() -> None:
            c = Client(autostart=True)
            try:
                await c._ensure_ready()
            finally:
                await c.close()
        _run(wait())
        console.print(f"dsec is serving at http://{host}:{port} (log: {Paths.from_env().server_log})")
        return
    from dsec.apiserver.server import ServerOptions, serve
    serve(Paths.from_env(), ServerOptions(host=host, port=port, node_id=node_id, log_level=log_level))


@app.command()
def down(timeout_s: float = 20.0) -> None:
    """Stop the background server. Sandboxes keep running and are picked up by the next `up`."""
    pid_file = Paths.from_env().server_pid
    if not pid_file.exists():
        console.print("dsec is not running")
        return
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            console.print("dsec stopped")
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    console.print("dsec killed after timeout")


# -- images ----------------------------------------------------------------------------------
def _images():
    from dsec.images.service import ImageService
    paths = Paths.from_env()
    paths.ensure()
    return ImageService(paths)


@image_app.command("build")
def image_build(name: str,
                from_dir: Annotated[Optional[Path], typer.Option(help="a rootfs directory")] = None,
                from_tar: Annotated[Optional[Path], typer.Option(help="a rootfs tarball")] = None,
                debootstrap: Annotated[Optional[str], typer.Option(help="Debian suite, e.g. bookworm")] = None,
                include: Annotated[str, typer.Option(help="comma-separated packages for debootstrap")] = "",
                builtin: Annotated[bool, typer.Option(help="build the built-in image NAME (busybox, debian-python, fncall-python)")] = False,
                replace: bool = False) -> None:
    """Build an image (one EROFS layer) and register it under NAME."""
    from dsec.images.builtin import ensure_builtin
    svc = _images()
    sources = [x for x in (from_dir, from_tar, debootstrap) if x] + ([True] if builtin else [])
    if len(sources) != 1:
        _fail(DsecError("give exactly one source", field="source",
                        fix="use one of --from-dir, --from-tar, --debootstrap, --builtin"))
    try:
        if builtin:
            info = ensure_builtin(svc, name)
        elif from_dir:
            info = svc.build_from_dir(name, from_dir, replace=replace)
        elif from_tar:
            info = svc.build_from_tar(name, from_tar, replace=replace)
        else:
            info = svc.build_debootstrap(name, suite=debootstrap, include=[p for p in include.split(",") if p],
                                         replace=replace)
    except DsecError as e:
        _fail(e)
    console.print(f"{info.name} {info.digest} {info.size_bytes / 1e6:.1f} MB")


@image_app.command("ls")
def image_ls() -> None:
    t = Table("name", "digest", "layers", "size MB", "created")
    for i in _images().list():
        t.add_row(i.name, i.digest[:19], str(len(i.layers)), f"{i.size_bytes / 1e6:.1f}", i.created_at.isoformat(timespec="seconds"))
    console.print(t)


@image_app.command("rm")
def image_rm(name: str) -> None:
    try:
        _images().remove(name)
    except DsecError as e:
        _fail(e)


@image_app.command("import")
def image_import(name: str,
                 oci: Annotated[Optional[Path], typer.Option(help="an OCI image layout directory")] = None,
                 docker_archive: Annotated[Optional[Path], typer.Option(help="a `docker save` tarball")] = None,
                 ref: Annotated[Optional[str], typer.Option(help="manifest ref name in the OCI index")] = None,
                 merge_mb: Annotated[int, typer.Option(help="merge consecutive OCI layers up to this size")] = 3072,
                 replace: bool = False) -> None:
    """Import an OCI / docker-archive image as EROFS layers (whiteouts kept)."""
    try:
        info = _images().import_oci(name, oci=oci, docker_archive=docker_archive, ref=ref,
                                    merge_bytes=merge_mb << 20, replace=replace)
    except DsecError as e:
        _fail(e)
    console.print(f"{info.name} {info.digest} {len(info.layers)} layer(s) {info.size_bytes / 1e6:.1f} MB")


@image_app.command("gc")
def image_gc() -> None:
    """Delete layer files no image or layer references any more."""
    try:
        dead = _images().gc()
    except DsecError as e:
        _fail(e)
    console.print(f"deleted {len(dead)} layer file(s)")


# -- named layers (workspaces, toolkits) -----------------------------------------------------
layer_app = typer.Typer(no_args_is_help=True, help="build, list, inspect and remove workspace/toolkit layers")
app.add_typer(layer_app, name="layer")


@layer_app.command("build")
def layer_build(name: Annotated[str, typer.Argument(help="NAME@VERSION, e.g. django-15388@v2")],
                from_dir: Annotated[Optional[Path], typer.Option(help="a directory (its tree is the layer)")] = None,
                from_tar: Annotated[Optional[Path], typer.Option(help="a tarball")] = None,
                from_git: Annotated[Optional[Path], typer.Option(help="a git checkout (git archive REV)")] = None,
                rev: str = "HEAD",
                prefix: Annotated[str, typer.Option(help="where git files land, e.g. work/repo")] = "",
                chown: Annotated[Optional[str], typer.Option(help="UID[:GID] for every entry")] = None,
                replace: bool = False) -> None:
    """Build a layer and register it as NAME@VERSION."""
    try:
        info = _images().build_layer(name, from_dir=from_dir, from_tar=from_tar, from_git=from_git,
                                     rev=rev, prefix=prefix, chown=chown, replace=replace)
    except DsecError as e:
        _fail(e)
    console.print(f"{info.name} {info.digest} {info.size_bytes / 1e6:.1f} MB")


@layer_app.command("ls")
def layer_ls() -> None:
    t = Table("name", "digest", "layers", "size MB", "created")
    for i in _images().list():
        if i.kind == "layer":
            t.add_row(i.name, i.digest[:19], str(len(i.layers)), f"{i.size_bytes / 1e6:.1f}",
                      i.created_at.isoformat(timespec="seconds"))
    console.print(t)


@layer_app.command("inspect")
def layer_inspect(name: str) -> None:
    try:
        info = _images().get(name, "name")
    except DsecError as e:
        _fail(e)
    print(info.model_dump_json(indent=2))


@layer_app.command("rm")
def layer_rm(name: str) -> None:
    try:
        _images().remove(name)
    except DsecError as e:
        _fail(e)


# -- sandboxes -------------------------------------------------------------------------------
def _client():
    from dsec.sdk.client import Client
    return Client()


@sandbox_app.command("create")
def sandbox_create(image: str, cpu: float = 1.0, memory_mb: int = 512, ttl_idle_s: int = 600,
                   user: Optional[str] = None) -> None:
    async def go() -> None:
        async with _client() as c:
            sb = await c.create_container(ContainerArgs(image=image, cpu_cores=cpu, memory_mb=memory_mb,
                                                        ttl_idle_s=ttl_idle_s, user=user))
            console.print(sb.id)
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


@sandbox_app.command("exec", context_settings={"allow_extra_args": True})
def sandbox_exec(sandbox_id: str, cmd: Annotated[list[str], typer.Argument(help="command (after --)")],
                 session: Optional[str] = None, timeout_s: float = 300.0) -> None:
    async def go() -> int:
        async with _client() as c:
            return await _stream_to_terminal(await c.get(sandbox_id), " ".join(cmd), session, timeout_s)
    raise typer.Exit(_run(go()))


@sandbox_app.command("ls")
def sandbox_ls(all: Annotated[bool, typer.Option("--all", help="include stopped and failed")] = False) -> None:
    async def go() -> None:
        async with _client() as c:
            t = Table("id", "state", "image", "cpu", "mem MiB", "created", "error")
            for s in await c.list(include_ended=all):
                t.add_row(s.id, s.state.value, s.image, f"{s.cpu_cores:g}", str(s.memory_mb),
                          s.created_at.isoformat(timespec="seconds"), s.error or "")
            console.print(t)
    _run(go())


@sandbox_app.command("rm")
def sandbox_rm(sandbox_ids: list[str]) -> None:
    async def go() -> None:
        async with _client() as c:
            for sid in sandbox_ids:
                await (await c.get(sid)).stop()
                console.print(f"stopped {sid}")
    _run(go())


@app.command("run", context_settings={"allow_extra_args": True})
def run(image: str, cmd: Annotated[list[str], typer.Argument(help="command (after --)")],
        cpu: float = 1.0, memory_mb: int = 512, timeout_s: float = 300.0, user: Optional[str] = None) -> None:
    """Create a sandbox from IMAGE, run CMD in it (output streamed), then remove it."""
    async def go() -> int:
        async with _client() as c:
            sb = await c.create_container(ContainerArgs(image=image, cpu_cores=cpu, memory_mb=memory_mb, user=user))
            try:
                return await _stream_to_terminal(sb, " ".join(cmd), None, timeout_s)
            finally:
                await sb.stop()
    raise typer.Exit(_run(go()))


# -- benchmarks ------------------------------------------------------------------------------
@bench_app.command("core")
def bench_core(n_create: int = 200, n_idle: int = 500, n_exec: int = 300,
               out: Path = Path("docs/benchmarks.md")) -> None:
    """Creation rate vs raw crun, exec round trip, memory per idle sandbox, time to first output."""
    from dsec.bench.core import run_core_bench
    run_core_bench(n_create=n_create, n_idle=n_idle, n_exec=n_exec, out=out)


@bench_app.command("fncall")
def bench_fncall(n_python: int = 3000, n_c: int = 300, n_sandbox: int = 30, n_latency: int = 200,
                 concurrency: int = 64, sandbox_parallel: int = 2,
                 out: Path = Path("docs/benchmarks.md")) -> None:
    """FnCall (warm pool) vs a container sandbox per call: calls/s and p50/p99, python and C."""
    from dsec.bench.fncall import run_fncall_bench
    run_fncall_bench(n_python=n_python, n_c=n_c, n_sandbox=n_sandbox, n_latency=n_latency,
                     concurrency=concurrency, sandbox_parallel=sandbox_parallel, out=out)


@bench_app.command("images")
def bench_images(image: str = "debian-python", latency_ms: float = 5.0, chunk_mb: int = 2,
                 out: Path = Path("docs/benchmarks.md")) -> None:
    """Lazy (FUSE, on-demand chunks) vs full copy vs tar.gz unpack: bytes fetched, time to ready."""
    from dsec.bench.images import run_images_bench
    rows = run_images_bench(image=image, latency_ms=latency_ms, chunk=chunk_mb << 20)
    t = Table("way", "image MB", "fetched MB", "fetched %", "ready s",
              title=f"{image}, {latency_ms:g} ms per {chunk_mb} MiB request")
    md = [f"\n## images — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n",
          f"Command: `dsec bench images --image {image} --latency-ms {latency_ms:g} --chunk-mb {chunk_mb}`: "
          "one image, started cold each way (`/bin/sh -c true` in a chroot of it), store with injected "
          "per-request latency; ratios are against the full copy in the same run.\n",
          "| way | image MB | fetched MB | fetched % | ready s | ready vs full copy |", "|---|---|---|---|---|---|"]
    full = next((r for r in rows if r["way"].startswith("full")), rows[0])
    for r in rows:
        cells = (r["way"], f"{r['image_bytes'] / 1e6:.1f}", f"{r['bytes_fetched'] / 1e6:.1f}",
                 f"{100 * r['bytes_fetched'] / r['image_bytes']:.1f}", f"{r['ready_s']:.2f}")
        t.add_row(*cells)
        md.append(f"| {' | '.join(cells)} | {r['ready_s'] / max(full['ready_s'], 1e-9):.2f} |")
    console.print(t)
    with out.open("a") as f:
        f.write("\n".join(md) + "\n")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
