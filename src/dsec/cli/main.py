"""`dsec` command line: serve, images, sandboxes, one-shot runs, benchmarks.

Module level imports only what the client commands need (the core install); server-side
modules (dsec.embedded, dsec.images, dsec.backends, dsec.bench) are imported inside the
commands that use them, and main() turns a missing [server] extra into one clear error.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from datetime import datetime, timezone
import os
import signal
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsec.config import DEFAULT_PORT, SERVER_INSTALL, missing_server_module
from dsec.types import ContainerArgs, DsecError, MicroVMArgs, VMArgs

if TYPE_CHECKING:
    from dsec.settings import Settings

app = typer.Typer(no_args_is_help=True, help="dsec: elastic sandboxes for agent training and evaluation")
image_app = typer.Typer(no_args_is_help=True, help="build, list and remove images")
sandbox_app = typer.Typer(no_args_is_help=True, help="create, exec into, list and remove sandboxes")
bench_app = typer.Typer(no_args_is_help=True, help="benchmarks, side by side with baselines")
app.add_typer(image_app, name="image")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(bench_app, name="bench")
project_app = typer.Typer(no_args_is_help=True, help="projects: sub-projects, quotas, sandbox policy")
app.add_typer(project_app, name="project")
key_app = typer.Typer(no_args_is_help=True, help="API keys of a project: create, list, revoke")
app.add_typer(key_app, name="key")
from dsec.cluster.cli import cluster_app  # noqa: E402  (cluster mode on Ray; imports Ray only when run)
app.add_typer(cluster_app, name="cluster")
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


# -- server ----------------------------------------------------------------------------------
@app.command()
def up(host: str = "127.0.0.1", port: int = DEFAULT_PORT, node_id: str = "local",
       background: Annotated[bool, typer.Option(help="start in the background and return when ready")] = False,
       log_level: str = "INFO") -> None:
    """Serve the apiserver with one embedded edge (the single-machine default)."""
    if background:
        from dsec.sdk.client import Client
        os.environ["DSEC_URL"] = f"http://{host}:{port}"    # where it serves, whatever DSEC_URL said
        log_file = _settings().paths.server_log   # private before the server writes to it
        log_file.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        os.chmod(log_file, 0o600)

        async def wait() -> None:
            c = Client(autostart=True)
            try:
                await c.ready()
            finally:
                await c.close()
        _run(wait())
        console.print(f"dsec is serving at http://{host}:{port} (log: {_settings().paths.server_log})")
        return
    from dsec.embedded.server import ServerOptions, serve
    try:
        serve(_settings(), ServerOptions(host=host, port=port, node_id=node_id, log_level=log_level))
    except DsecError as e:      # a bad setting (e.g. DSEC_NODE_CPU_CORES): its message and fix, no traceback
        _fail(e)


@app.command("config")
def config(as_json: Annotated[bool, typer.Option("--json", help="one JSON object per setting")] = False,
           changed: Annotated[bool, typer.Option(help="only the settings the environment sets")] = False) -> None:
    """The effective settings of a server started here: name, value, source (env or default);
    secrets masked. Every setting: docs/settings.md."""
    from dsec.settings import unknown_names
    rows = [r for r in _settings().rows() if r[2] == "env" or not changed]
    if as_json:
        for name, value, source in rows:
            console.print_json(json.dumps({"name": name, "value": value, "source": source}))
    else:
        t = Table("name", "value", "source")
        for name, value, source in rows:
            t.add_row(name, escape(value), source)
        console.print(t)
    for name in unknown_names():
        err_console.print(f"[yellow]warning[/yellow]: {name} is set but is no dsec setting (a typo?)")


@app.command()
def down(timeout_s: float = 20.0) -> None:
    """Stop the background server. Sandboxes keep running and are picked up by the next `up`."""
    from dsec.embedded.serverlock import serving_pid
    pid = serving_pid(_settings().paths)     # the lock's holder: found even if server.pid is gone
    if pid is None:
        _settings().paths.server_pid.unlink(missing_ok=True)     # a crashed server's leftover
        console.print("dsec is not running")
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
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
    paths = _settings().paths
    paths.ensure()
    return ImageService(paths, settings=_settings().images)


@image_app.command("build")
def image_build(name: str,
                from_dir: Annotated[Optional[Path], typer.Option(help="a rootfs directory")] = None,
                from_tar: Annotated[Optional[Path], typer.Option(help="a rootfs tarball")] = None,
                debootstrap: Annotated[Optional[str], typer.Option(help="Debian suite, e.g. bookworm")] = None,
                include: Annotated[str, typer.Option(help="comma-separated packages for debootstrap")] = "",
                builtin: Annotated[bool, typer.Option(help="build the built-in image NAME (busybox, debian-python, fncall-python)")] = False,
                dockerfile: Annotated[Optional[Path], typer.Option(help="a build context dir with a Dockerfile (buildah; FROM names a dsec image)")] = None,
                file: Annotated[str, typer.Option(help="the Dockerfile's name inside --dockerfile")] = "Dockerfile",
                build_arg: Annotated[Optional[list[str]], typer.Option(help="KEY=VALUE for the Dockerfile's ARGs")] = None,
                network: Annotated[bool, typer.Option(help="let RUN steps use the host's network (default: none)")] = False,
                replace: bool = False) -> None:
    """Build an image (one EROFS layer) and register it under NAME."""
    from dsec.images.builtin import ensure_builtin
    svc = _images()
    sources = [x for x in (from_dir, from_tar, debootstrap, dockerfile) if x] + ([True] if builtin else [])
    if len(sources) != 1:
        _fail(DsecError("give exactly one source", field="source",
                        fix="use one of --from-dir, --from-tar, --debootstrap, --builtin, --dockerfile"))
    try:
        if dockerfile:
            from dsec.images.dockerfile import build_dockerfile, parse_build_args
            from dsec.images.progress import rich_progress
            with rich_progress(f"building {name}") as progress:
                info = build_dockerfile(svc, name, dockerfile, dockerfile=file, network=network, replace=replace,
                                        build_args=parse_build_args(build_arg or []), progress=progress).image
        elif builtin:
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


@image_app.command("pull")
def image_pull(name: str,
               ref: Annotated[str, typer.Argument(help="docker://HOST[:PORT]/REPO[:TAG]")],
               tls_verify: Annotated[bool, typer.Option(help="require HTTPS with a valid certificate")] = True,
               creds: Annotated[Optional[str], typer.Option(help="USER:PASSWORD for the registry")] = None,
               merge_mb: Annotated[int, typer.Option(help="merge consecutive OCI layers up to this size")] = 3072,
               replace: bool = False) -> None:
    """Pull an image from a registry (through skopeo) and import it as EROFS layers."""
    try:
        info = _images().pull(name, ref, tls_verify=tls_verify, creds=creds,
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


@image_app.command("publish")
def image_publish(name: str) -> None:
    """Publish an image or layer of this node to the shared layer store (DSEC_LAYER_STORE);
    builds publish by themselves, this is for ones made before the store was set."""
    try:
        svc = _images()
        info = svc.publish(name)
    except DsecError as e:
        _fail(e)
    console.print(f"{info.name} {info.digest} published to {svc.shared.url if svc.shared else '?'}")


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


@project_app.command("policy")
def project_policy(project_id: str) -> None:
    """Show a project's own and effective sandbox policy (JSON)."""
    async def go() -> None:
        async with _client() as c:
            console.print_json(data=await c.get_policy(project_id))
    _run(go())


@project_app.command("policy-set")
def project_policy_set(project_id: str,
                       policy: Annotated[str, typer.Argument(help='JSON, e.g. \'{"rulesets": ["pypi"], '
                                                                   '"cidrs": [], "max_memory_mb": 4096}\'')]) -> None:
    """Replace a project's own sandbox policy (needs a key of a parent project)."""
    async def go() -> None:
        async with _client() as c:
            console.print_json(data=await c.set_policy(project_id, json.loads(policy)))
    _run(go())


QuotaOpt = typer.Option(help="omitted: inherit the parent's (create) or keep (quota)")


@project_app.command("create")
def project_create(name: str, parent: Annotated[Optional[str], typer.Option(help="parent project id (default: your key's)")] = None,
                   max_sandboxes: Annotated[Optional[int], QuotaOpt] = None,
                   max_cpu_cores: Annotated[Optional[float], QuotaOpt] = None,
                   max_memory_mb: Annotated[Optional[int], QuotaOpt] = None) -> None:
    """Create a sub-project with part of its parent's quota (never more than the parent holds)."""
    async def go() -> None:
        async with _client() as c:
            p = await c.create_project(name, parent, max_sandboxes=max_sandboxes, max_cpu_cores=max_cpu_cores,
                                       max_memory_mb=max_memory_mb)
            console.print(p.id)
    _run(go())


@project_app.command("ls")
def project_ls() -> None:
    """Your project and every project below it."""
    async def go() -> None:
        async with _client() as c:
            t = Table("id", "name", "parent", "max sandboxes", "max cores", "max MiB")
            for p in await c.projects():
                t.add_row(p.id, p.name, p.parent_id or "-", str(p.max_sandboxes), f"{p.max_cpu_cores:g}",
                          str(p.max_memory_mb))
            console.print(t)
    _run(go())


@project_app.command("rm")
def project_rm(project_id: str) -> None:
    """Remove an empty project (no sub-projects, no sandboxes) with its keys."""
    async def go() -> None:
        async with _client() as c:
            await c.delete_project(project_id)
    _run(go())


@project_app.command("quota")
def project_quota(project_id: str, max_sandboxes: Annotated[Optional[int], QuotaOpt] = None,
                  max_cpu_cores: Annotated[Optional[float], QuotaOpt] = None,
                  max_memory_mb: Annotated[Optional[int], QuotaOpt] = None) -> None:
    """Show a project's quota and usage; with options, change it (needs a key of a parent)."""
    async def go() -> None:
        async with _client() as c:
            if (max_sandboxes, max_cpu_cores, max_memory_mb) == (None, None, None):
                q = await c.quota(project_id)
            else:
                q = await c.set_quota(project_id, max_sandboxes=max_sandboxes, max_cpu_cores=max_cpu_cores,
                                      max_memory_mb=max_memory_mb)
            t = Table("", "used", "max")
            t.add_row("sandboxes", str(q.used.sandboxes), str(q.max_sandboxes))
            t.add_row("cpu cores", f"{q.used.cpu_cores:g}", f"{q.max_cpu_cores:g}")
            t.add_row("memory MiB", str(q.used.memory_mb), str(q.max_memory_mb))
            console.print(t)
    _run(go())


@key_app.command("create")
def key_create(project_id: str) -> None:
    """Mint an API key of the project; prints the secret (shown this once)."""
    async def go() -> None:
        async with _client() as c:
            console.print((await c.create_key(project_id)).key)
    _run(go())


@key_app.command("ls")
def key_ls(project_id: str) -> None:
    async def go() -> None:
        async with _client() as c:
            t = Table("id", "prefix", "created", "revoked")
            for k in await c.keys(project_id):
                t.add_row(k.id, k.prefix + "...", k.created_at.isoformat(timespec="seconds"), "yes" if k.revoked else "")
            console.print(t)
    _run(go())


@key_app.command("rotate")
def key_rotate(key_id: Annotated[str, typer.Argument(help="the key's id (`dsec key ls`); 'self': the key in use")] = "self",
               grace_s: Annotated[float, typer.Option(help="how long the old key keeps working (0: ends now)")] = 3600.0,
               admin: Annotated[bool, typer.Option(help="rotate the node's admin key and write the new one to "
                                                        "DSEC_HOME/admin.key")] = False) -> None:
    """Replace a key without downtime: prints the new key; the old one works for --grace-s more."""
    from dsec.sdk.client import Client
    paths = _settings().paths

    async def go() -> None:
        if admin:
            if key_id != "self":
                raise DsecError("--admin rotates the admin key itself", field="key_id", fix="leave KEY_ID off")
            async with Client(api_key=paths.admin_key_file.read_text().strip()) as c:
                new = await c.rotate_key("self", grace_s=grace_s)
            tmp = paths.admin_key_file.with_name(f".admin.key.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(new.key + "\n")
            tmp.replace(paths.admin_key_file)       # atomic: readers see the old key or the new one
            console.print(f"admin key rotated: {paths.admin_key_file} holds the new key {new.id}; the old one "
                          f"works for {grace_s:.0f} s more")
            return
        async with _client() as c:
            console.print((await c.rotate_key(key_id, grace_s=grace_s)).key)
    _run(go())


@key_app.command("revoke")
def key_revoke(key_id: str) -> None:
    async def go() -> None:
        async with _client() as c:
            await c.revoke_key(key_id)
    _run(go())


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
    """Save a running VM; create new sandboxes from it with its snapshot id."""
    async def go() -> None:
        async with _client() as c:
            snap = await (await c.get(sandbox_id)).snapshot()
            console.print(f"{snap.id}  ({snap.size_bytes / 2**20:.1f} MiB)")
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


@app.command("run", context_settings={"allow_extra_args": True})
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


@bench_app.command("density")
def bench_density(
        n: Annotated[int, typer.Option(help="idle sandboxes to create (stops earlier at the first refusal)")] = 3200,
        image: str = "debian-python",
        cpu: Annotated[float, typer.Option(help="cpu_cores of each idle sandbox")] = 0.005,
        memory_mb: Annotated[int, typer.Option(help="memory_mb of each idle sandbox")] = 48,
        park: Annotated[Optional[int], typer.Option(help="sandboxes to park and resume [default: min(1000, n)]")] = None,
        concurrency: Annotated[int, typer.Option(help="creations/suspends/resumes/stops in flight (and raw crun "
                                                      "runs in parallel)")] = 8,
        raw_n: Annotated[int, typer.Option(help="raw crun containers of the baseline")] = 200,
        burst: Annotated[int, typer.Option(help="concurrent create -> first output, of each")] = 50,
        exec_sample: Annotated[int, typer.Option(help="sandboxes sampled for `exec true` latency")] = 200,
        pressure_retries: Annotated[int, typer.Option(help="PSI pressure refusals waited out (10 s each) before "
                                                           "the node counts as full")] = 0,
        json_path: Annotated[Optional[Path], typer.Option("--json", help="save the raw numbers here")] = None,
        record: Annotated[bool, typer.Option(help="append the summary to --out")] = True,
        out: Path = Path("docs/benchmarks.md")) -> None:
    """Most idle sandboxes the node holds, host memory per idle and parked sandbox, bulk park/resume,
    burst create -> first output; side by side with raw crun."""
    from dsec.bench.density import Opts
    from dsec.bench.density_report import run_density_bench
    run_density_bench(Opts(n=n, image=image, cpu=cpu, memory_mb=memory_mb, park=park, concurrency=concurrency,
                           raw_n=raw_n, burst=burst, exec_sample=exec_sample, pressure_retries=pressure_retries),
                      out=out if record else None, json_path=json_path)


@bench_app.command("warmpool")
def bench_warmpool(
        burst: Annotated[int, typer.Option(help="concurrent creates per burst, and the pool's size")] = 50,
        serial: Annotated[int, typer.Option(help="one-at-a-time creates, cold and warm")] = 10,
        image: str = "debian-python",
        json_out: Annotated[Optional[Path], typer.Option("--json", help="write the raw results here")] = None,
        out: Annotated[Optional[Path], typer.Option(help="append the markdown table here")] = None) -> None:
    """Create -> first output with and without a warm pool, vs raw `crun run`, in one run."""
    from dsec.bench.warmpool import Opts as WarmOpts, run_warmpool_bench
    run_warmpool_bench(WarmOpts(burst=burst, serial=serial, image=image), out=out, json_out=json_out)


@bench_app.command("vm")
def bench_vm(n: Annotated[int, typer.Option(help="clones and cold boots, one at a time, of each")] = 10,
             burst: Annotated[int, typer.Option(help="VMs started in parallel, of each")] = 4,
             n_idle: Annotated[int, typer.Option(help="idle VMs alive at once, of each, for memory")] = 20,
             idle_s: float = 5.0, n_exec: int = 200,
             n_vm: Annotated[int, typer.Option(help="q35 clones and cold boots (0: skip q35)")] = 3,
             memory_mb: int = 256, vcpus: int = 1,
             image: Annotated[str, typer.Option(help="busybox or debian-python")] = "busybox",
             out: Path = Path("docs/benchmarks.md")) -> None:
    """microVM clone-from-snapshot vs cold boot: time to first command, PSS per idle VM, exec round trip."""
    from dsec.bench.vm import Opts, run_vm_bench
    run_vm_bench(Opts(n=n, burst=burst, n_idle=n_idle, idle_s=idle_s, n_exec=n_exec, n_vm=n_vm,
                      memory_mb=memory_mb, vcpus=vcpus, image=image), out=out)


@bench_app.command("qos")
def bench_qos(steps: Annotated[int, typer.Option(help="agent steps per mode per round")] = 25,
              rounds: Annotated[int, typer.Option(help="rounds of alone / unprotected / protected, interleaved")] = 20,
              step_ms: Annotated[float, typer.Option(help="CPU work of one step alone (calibrated)")] = 20.0,
              gap_ms: Annotated[float, typer.Option(help="sleep before each step")] = 10.0,
              busy_ms: Annotated[float, typer.Option(help="load worker: CPU time per cycle")] = 10.0,
              idle_ms: Annotated[float, typer.Option(help="load worker: sleep per cycle")] = 10.0,
              load_sandboxes: Annotated[int, typer.Option(help="load sandboxes per class (0: one per core)")] = 0,
              out: Path = Path("docs/benchmarks.md")) -> None:
    """CPU QoS classes: a latency sandbox's step latency alone, beside 50% load of the same class, beside batch load."""
    from dsec.bench.qos import Opts, run_qos_bench
    run_qos_bench(Opts(steps=steps, rounds=rounds, step_ms=step_ms, gap_ms=gap_ms, busy_ms=busy_ms,
                       idle_ms=idle_ms, load_sandboxes=load_sandboxes), out=out)


@bench_app.command("cluster")
def bench_cluster(n: Annotated[int, typer.Option(help="sandboxes created per round, per arm")] = 60,
                  concurrency: Annotated[int, typer.Option(help="creates in flight at once")] = 8,
                  rounds: int = 2) -> None:
    """Creations/s through 2 apiserver replicas and 3 edges (a local Ray cluster) vs one embedded server."""
    from dsec.cluster.bench import main as bench_main
    bench_main(n, concurrency, rounds)


@bench_app.command("cluster-sim")
def bench_cluster_sim(
        nodes: int = 160, live: Annotated[int, typer.Option(help="live sandboxes at start (and kept near)")] = 380_000,
        rate: Annotated[float, typer.Option(help="creations per second of simulated time")] = 5000.0,
        duration: Annotated[float, typer.Option(help="simulated seconds per policy")] = 30.0,
        poll: Annotated[float, typer.Option(help="watcher poll interval, simulated seconds")] = 1.0,
        images: int = 2000, cache_images: Annotated[int, typer.Option(help="images each node keeps")] = 32,
        hot_share: Annotated[float, typer.Option(help="share of creations for one new image")] = 0.2,
        hot_nodes: Annotated[int, typer.Option(help="nodes that hold the new image at the start")] = 2,
        fail_every: Annotated[float, typer.Option(help="a node dies every this many seconds")] = 10.0,
        down: Annotated[float, typer.Option(help="seconds a dead node stays down")] = 15.0,
        seed: int = 1,
        policies: Annotated[str, typer.Option(help="comma-separated: random, p2-stale, p2, p3, p2+loc, "
                                                   "p2+loc0.2, p2+local-first")]
        = "random,p2-stale,p2,p2+loc,p2+local-first",
        out: Annotated[Optional[Path], typer.Option(help="append the markdown report to this file")] = None) -> None:
    """The real placer and watcher over simulated edges: decision latency, imbalance, rejects, locality (D34)."""
    from dsec.bench.cluster_sim import Opts, report, run
    o = Opts(nodes=nodes, live=live, rate=rate, duration_s=duration, poll_s=poll, images=images,
             cache_images=cache_images, hot_share=hot_share, hot_nodes=hot_nodes, fail_every_s=fail_every,
             down_s=down, seed=seed,
             policies=tuple(p.strip() for p in policies.split(",") if p.strip()))
    try:
        text = report(o, run(o))
    except DsecError as e:
        _fail(e)
    print(text)
    if out is not None:
        with out.open("a") as f:
            f.write(f"\n## cluster-sim — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n\n{text}\n")


@bench_app.command("images")
def bench_images(image: str = "debian-python", latency_ms: float = 5.0, chunk_mb: int = 2,
                 out: Path = Path("docs/benchmarks.md"),
                 suite: Annotated[str, typer.Option(help="'small': one image, three ways; 'env': the "
                                                         ">= 1 GB environment suite (issue 3)")] = "small",
                 chunk_kb: Annotated[int, typer.Option(help="env suite: lazy data chunk size")] = 2048,
                 bandwidth_mbps: Annotated[float, typer.Option(help="env suite: store bandwidth")] = 100.0,
                 envs: int = 10, sandboxes: int = 50, parallel: int = 2, workspaces: int = 100,
                 mono_sample: Annotated[int, typer.Option(help="env suite: monolithic rebuilds done "
                                                              "for real (scaled to --workspaces)")] = 3,
                 tar_sample: Annotated[int, typer.Option(help="env suite: tar.gz sandboxes run for "
                                                             "real (scaled to --sandboxes)")] = 6,
                 work: Annotated[Path, typer.Option(help="env suite: cache of the built environments")]
                 = Path("/var/cache/dsec-bench")) -> None:
    """Lazy (FUSE, on-demand chunks) vs full copy vs tar.gz unpack: bytes fetched, time to ready."""
    if suite == "env":
        from dsec.bench.images_report import run_and_report_env
        run_and_report_env(out=out, work=work, latency_ms=latency_ms, chunk_kb=chunk_kb,
                           bandwidth_mbps=bandwidth_mbps, envs=envs, sandboxes=sandboxes,
                           parallel=parallel, workspaces=workspaces, mono_sample=mono_sample,
                           tar_sample=tar_sample)
        return
    if suite != "small":
        err_console.print("[red]error[/red]: --suite must be 'small' or 'env'")
        raise typer.Exit(2)
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


# -- VM guest artefacts -------------------------------------------------------------------------
vm_app = typer.Typer(no_args_is_help=True, help="microVM / full-VM guest kernel and initramfs")
app.add_typer(vm_app, name="vm")


@vm_app.command("fetch-kernel")
def vm_fetch_kernel(
        initramfs: Annotated[bool, typer.Option(help="also build the guest initramfs")] = True) -> None:
    """Download and unpack the guest kernel (linux-image-cloud-amd64) into DSEC_HOME (cached)."""
    from dsec.backends.vm import guest
    paths = _settings().paths
    try:
        k = guest.ensure_kernel(paths)
        console.print(f"guest kernel {k.version}: {k.vmlinuz}")
        if initramfs:
            console.print(f"guest initramfs: {guest.build_initramfs(paths, k)}")
    except guest.GuestError as e:
        err_console.print(f"[red]error[/red]: {e}")
        raise typer.Exit(2)


vm_snapshot_app = typer.Typer(no_args_is_help=True, help="VM snapshots (dsec sandbox snapshot ID takes one)")
vm_app.add_typer(vm_snapshot_app, name="snapshot")


@vm_snapshot_app.command("ls")
def vm_snapshot_ls() -> None:
    """List the snapshots of your project and its sub-projects."""
    async def go() -> None:
        async with _client() as c:
            t = Table("id", "backend", "image", "project", "from sandbox", "MiB", "created")
            for s in await c.snapshots():
                t.add_row(s.id, s.backend, s.image, s.project, s.sandbox_id, f"{s.size_bytes / 2**20:.1f}",
                          s.created_at.isoformat(timespec="seconds"))
            console.print(t)
    _run(go())


@vm_snapshot_app.command("rm")
def vm_snapshot_rm(snapshot_ids: list[str]) -> None:
    """Delete snapshots (sandboxes restored from them keep running and can still be suspended)."""
    async def go() -> None:
        async with _client() as c:
            for sid in snapshot_ids:
                await c.delete_snapshot(sid)
                console.print(f"deleted {sid}")
    _run(go())


vm_disk_app = typer.Typer(no_args_is_help=True, help="bootable full-VM disks: an image's own kernel and init as qcow2")
vm_app.add_typer(vm_disk_app, name="disk")


@vm_disk_app.command("build")
def vm_disk_build(
        name: Annotated[str, typer.Argument(help="disk name (then VMArgs(image=IMAGE, disk=NAME))")],
        image: Annotated[str, typer.Option("--image", help="image with /boot/vmlinuz-* and systemd as /sbin/init")],
        size_mb: Annotated[Optional[int], typer.Option("--size-mb", help="filesystem size (default: 2x the files + 512 MiB, at least 1024)")] = None) -> None:
    """Build DSEC_HOME/vm/disks/NAME.qcow2 from IMAGE's layers, with the dsec agent as a systemd unit."""
    import time as _time

    from dsec.backends.vm import disks
    from dsec.types import DsecError
    t0 = _time.monotonic()
    try:
        d = disks.build(_settings().paths, name, image, size_mb=size_mb)
    except DsecError as e:
        err_console.print(f"[red]error[/red]: {e.message}" + (f" (field {e.field})" if e.field else "")
                          + (f"\n  fix: {e.fix}" if e.fix else ""))
        raise typer.Exit(2)
    console.print(f"vm disk {d.name}: image {d.image} ({d.image_digest[:19]}), kernel {d.kernel_version}, "
                  f"{d.size_mb} MiB, built in {_time.monotonic() - t0:.1f}s")


@vm_disk_app.command("ls")
def vm_disk_ls() -> None:
    """List the VM disks on this node."""
    from dsec.backends.vm import disks
    t = Table("name", "image", "digest", "kernel", "size MiB", "built")
    for d in disks.list_disks(_settings().paths):
        t.add_row(d.name, d.image, d.image_digest[:19], d.kernel_version, str(d.size_mb),
                  datetime.fromtimestamp(d.created_at, timezone.utc).isoformat(timespec="seconds"))
    console.print(t)


@vm_disk_app.command("rm")
def vm_disk_rm(name: Annotated[str, typer.Argument(help="disk name")]) -> None:
    """Remove a VM disk (VMs booted from it, running or suspended, and their snapshots keep their own link to it)."""
    from dsec.backends.vm import disks
    from dsec.types import DsecError
    try:
        disks.remove(_settings().paths, name)
    except DsecError as e:
        err_console.print(f"[red]error[/red]: {e.message}")
        raise typer.Exit(2)
    console.print(f"removed vm disk {name}")


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as e:
        module = missing_server_module(e)
        if module is None:
            raise
        # A server command (up, image, layer, bench, vm ...) on a client-only install.
        err_console.print(f"[red]error[/red]: this command runs dsec's server side, which is not installed "
                          f"(no module {escape(repr(module))})\n  fix: {escape(SERVER_INSTALL)}")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
