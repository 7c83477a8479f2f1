"""`dsec` command line: serve, images, sandboxes, one-shot runs, benchmarks.

One module per command group (images, tenants, sandboxes, bench, vm; the cluster's in
dsec.cluster.cli), sharing cli/common.py; here the server commands and the entry point.

Module level imports only what the client commands need (the core install); server-side
modules (dsec.embedded, dsec.images, dsec.backends, dsec.bench) are imported inside the
commands that use them, and main() turns a missing [server] extra into one clear error.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Annotated

from rich.markup import escape
from rich.table import Table
import typer

from dsec.cli.audit import audit as audit_cmd
from dsec.cli.bench import bench_app
from dsec.cli.cache import cache_app
from dsec.cli.common import _fail, _run, _settings, console, err_console
from dsec.cli.events import events as events_cmd, webhook_app
from dsec.cli.images import image_app, layer_app
from dsec.cli.sandboxes import run, sandbox_app
from dsec.cli.secrets import secret_app
from dsec.cli import top as _top  # noqa: F401  (registers `dsec sandbox top`)
from dsec.cli.nodes import nodes_app
from dsec.cli.tenants import key_app, project_app, ruleset_app
from dsec.cli.vm import vm_app
from dsec.cli.volumes import volume_app
from dsec.cluster.cli import cluster_app  # (cluster mode on Ray; imports Ray only when run)
from dsec.config import DEFAULT_PORT, SERVER_INSTALL, missing_server_module
from dsec.types import DsecError


app = typer.Typer(no_args_is_help=True, help="dsec: elastic sandboxes for agent training and evaluation")
for group, name in ((image_app, "image"), (sandbox_app, "sandbox"), (bench_app, "bench"), (project_app, "project"),
                    (key_app, "key"), (cluster_app, "cluster"), (layer_app, "layer"), (vm_app, "vm"),
                    (nodes_app, "nodes"), (ruleset_app, "ruleset"), (secret_app, "secret"), (volume_app, "volume"),
                    (cache_app, "cache")):
    app.add_typer(group, name=name)
app.add_typer(webhook_app, name="webhook")
app.command("events")(events_cmd)
app.command("audit")(audit_cmd)


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


app.command("run", context_settings={"allow_extra_args": True})(run)


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
