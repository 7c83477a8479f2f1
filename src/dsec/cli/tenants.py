"""`dsec project ...` and `dsec key ...`: projects, quotas, policies and API keys."""

from __future__ import annotations

import json
import os
from typing import Annotated, Optional

from rich.table import Table
import typer

from dsec.cli.common import _client, _run, _settings, console
from dsec.types import DsecError


project_app = typer.Typer(no_args_is_help=True, help="projects: sub-projects, quotas, sandbox policy")
key_app = typer.Typer(no_args_is_help=True, help="API keys of a project: create, list, revoke")
ruleset_app = typer.Typer(no_args_is_help=True, help="operators' named network rule sets (pypi, github, ...)")


@ruleset_app.command("ls")
def ruleset_ls() -> None:
    """Every rule set (JSON): what sandboxes turn on with network.rulesets."""
    async def go() -> None:
        async with _client() as c:
            console.print_json(data=(await c.rulesets())["rulesets"])
    _run(go())


@ruleset_app.command("set")
def ruleset_set(name: str,
                domain: Annotated[Optional[list[str]], typer.Option(help="a name or *.wildcard (repeat)")] = None,
                cidr: Annotated[Optional[list[str]], typer.Option(help="a network, all ports (repeat); "
                                                                       "finer rules: --rules JSON")] = None,
                rules: Annotated[Optional[str], typer.Option(help='JSON list, e.g. \'[{"cidr": "10.0.0.0/8", '
                                                                  '"ports": [443], "protocol": "tcp"}]\'')] = None
                ) -> None:
    """Define or replace a rule set (a key of the root project); sandboxes using it follow at once."""
    async def go() -> None:
        body = [*(json.loads(rules) if rules else []), *({"cidr": c} for c in cidr or [])]
        async with _client() as c:
            console.print_json(data=await c.set_ruleset(name, rules=body, domains=domain or []))
    _run(go())


@ruleset_app.command("rm")
def ruleset_rm(name: str) -> None:
    """Remove a rule set; sandboxes that turned it on lose what it allowed."""
    async def go() -> None:
        async with _client() as c:
            console.print_json(data=await c.delete_ruleset(name))
    _run(go())

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
def key_create(project_id: str,
               role: Annotated[str, typer.Option(help="admin (manages keys, reads the audit log) or member "
                                                      "(uses sandboxes only)")] = "admin") -> None:
    """Mint an API key of the project; prints the secret (shown this once)."""
    async def go() -> None:
        async with _client() as c:
            console.print((await c.create_key(project_id, role=role)).key)
    _run(go())


@key_app.command("ls")
def key_ls(project_id: str) -> None:
    async def go() -> None:
        async with _client() as c:
            t = Table("id", "prefix", "role", "created", "revoked")
            for k in await c.keys(project_id):
                t.add_row(k.id, k.prefix + "...", k.role, k.created_at.isoformat(timespec="seconds"),
                          "yes" if k.revoked else "")
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


