"""The audit log: who (which API key) created, changed, stopped or read what.

An ASGI middleware inside the guard (which authenticated the key) names each audited request
by its method and path (RULES: `resource.verb` and the path part that is its target) and
notes it when the answer starts, with its status: refusals are recorded too. A route may add
what only it knows (a new sandbox's id) with `note_target`. Nothing of the body is read:
no secret values, command text or file contents reach the log; a file's path does.

Noting is an append to a list; AuditLog writes the list to the control store in one
transaction every FLUSH_S (or sooner when BATCH entries wait), off the event loop, so the
exec path pays microseconds, not a commit (docs/decisions.md, "Audit log"). Entries older
than DSEC_AUDIT_RETENTION_S are pruned hourly.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from dsec.iam import Principal
from dsec.store.audit import AuditStore, Record

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext

log = logging.getLogger("dsec.apiserver")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

FLUSH_S = 0.5            # the longest an entry waits in memory
BATCH = 512              # ... or until this many wait
MAX_PENDING = 100_000    # the store is down: keep at most this many, then drop the oldest
PRUNE_EVERY_S = 3600.0


@dataclass(frozen=True)
class Rule:
    method: str
    path: re.Pattern[str]
    action: str
    query: tuple[str, ...] = ()     # query parameters recorded in details (a file's path)
    envd: bool = False              # E2B sandbox traffic: authenticated by the sandbox's access token


SB = r"/v1/sandboxes/(?P<target>[^/]+)"
E2B_SB = r"/e2b/(?:v2/)?sandboxes/(?P<target>[^/]+)"


def _r(method: str, path: str, action: str, *query: str, envd: bool = False) -> Rule:
    return Rule(method, re.compile(f"^{path}$"), action, query, envd)


# the E2B dispatcher's resolved sandbox (apiserver/e2b/envd_files.TARGET_KEY; not imported: the
# e2b modules need the [e2b] extra). Its traffic carries the sandbox's access token, which the
# key that created or connected to the sandbox was given: logged as that, under its project.
E2B_TARGET_KEY = "e2b_target"
E2B_TOKEN_ACTOR = "e2b-access-token"
E2B_ID = re.compile(r"^(?P<node>[A-Za-z0-9][A-Za-z0-9-]*)-(?P<rand>[0-9a-f]{12})$")   # <node>-<12 hex>


RULES: tuple[Rule, ...] = (
    # sandboxes: dsec's API, then E2B's REST API (its envd traffic is the sandbox's token's, not a key's)
    _r("POST", r"/v1/sandboxes", "sandbox.create"),
    _r("DELETE", SB, "sandbox.stop"),
    _r("PUT", SB + "/network", "network.set"),
    _r("POST", SB + "/timeout", "sandbox.update"),
    _r("POST", r"/v1/sandboxes/bulk/(?P<verb>suspend|resume)", "sandbox.bulk_{verb}"),   # before SB's
    _r("POST", SB + "/(?P<verb>suspend|resume|fork|snapshot|pack_diff)", "sandbox.{verb}"),
    _r("GET", SB + "/console", "sandbox.console"),
    _r("POST", SB + "/(?:exec|exec/stream|execs)", "exec.start"),
    _r("POST", SB + r"/execs/(?P<exec>[0-9]+)/signal", "exec.signal"),
    _r("GET", SB + "/files", "file.read", "path"),
    _r("PUT", SB + "/files", "file.write", "path"),
    _r("DELETE", SB + "/files", "file.remove", "path"),
    _r("GET", SB + "/files/list", "file.list", "path"),
    _r("POST", r"/e2b/(?:v2/)?sandboxes", "sandbox.create"),
    _r("DELETE", E2B_SB, "sandbox.stop"),
    _r("POST", E2B_SB + "/(?P<verb>pause|resume|connect|fork|snapshots)", "sandbox.{verb}"),
    _r("POST", E2B_SB + "/timeout", "sandbox.update"),
    _r("PUT", E2B_SB + "/network", "network.set"),
    _r("POST", r"/e2b/process\.Process/Start", "exec.start", envd=True),
    _r("POST", r"/e2b/process\.Process/SendSignal", "exec.signal", envd=True),
    _r("GET", r"/e2b/files", "file.read", "path", envd=True),
    _r("POST", r"/e2b/files", "file.write", "path", envd=True),
    _r("POST", r"/e2b/filesystem\.Filesystem/(?P<verb>Remove|Move|MakeDir)", "file.{verb}", envd=True),
    # code runs
    _r("POST", r"/(?:v1/fncall(?:/batch)?|run_code|run_jupyter)", "fncall.run"),
    # projects, keys, policies, secrets, webhooks, network rule sets
    _r("POST", r"/v1/projects", "project.create"),
    _r("DELETE", r"/v1/projects/(?P<target>[^/]+)", "project.delete"),
    _r("PUT", r"/v1/projects/(?P<target>[^/]+)/quota", "project.quota"),
    _r("PUT", r"/v1/projects/(?P<target>[^/]+)/policy", "policy.set"),
    _r("POST", r"/v1/projects/(?P<project>[^/]+)/keys", "key.create"),
    _r("POST", r"/v1/keys/(?P<target>[^/]+)/rotate", "key.rotate"),
    _r("DELETE", r"/v1/keys/(?P<target>[^/]+)", "key.revoke"),
    _r("POST", r"/v1/secrets", "secret.create"),
    _r("DELETE", r"/v1/secrets/(?P<target>[^/]+)", "secret.delete"),
    _r("POST", r"/v1/webhooks", "webhook.create"),
    _r("DELETE", r"/v1/webhooks/(?P<target>[^/]+)", "webhook.delete"),
    _r("POST", r"/e2b/events/webhooks", "webhook.create"),
    _r("PATCH", r"/e2b/events/webhooks/(?P<target>[^/]+)", "webhook.update"),
    _r("DELETE", r"/e2b/events/webhooks/(?P<target>[^/]+)", "webhook.delete"),
    _r("PUT", r"/v1/network/rulesets/(?P<target>[^/]+)", "ruleset.set"),
    _r("DELETE", r"/v1/network/rulesets/(?P<target>[^/]+)", "ruleset.delete"),
    # volumes, snapshots, images, nodes
    _r("POST", r"/v1/volumes", "volume.create"),
    _r("DELETE", r"/v1/volumes/(?P<target>[^/]+)", "volume.delete"),
    _r("DELETE", r"/v1/snapshots/(?P<target>[^/]+)", "snapshot.delete"),
    _r("POST", r"/v1/images/(?P<verb>build|import|pull)", "image.{verb}"),
    _r("POST", r"/v1/images/(?P<target>[^/]+)/publish", "image.publish"),
    _r("POST", r"/v1/nodes/(?P<target>[^/]+)/(?P<verb>cordon|drain|uncordon|forget)", "node.{verb}"),
    _r("PUT", r"/v1/nodes/(?P<target>[^/]+)/warm-pool", "node.warm_pool"),
)
_BY_METHOD: dict[str, tuple[Rule, ...]] = {m: tuple(r for r in RULES if r.method == m)
                                           for m in {r.method for r in RULES}}

# what a route adds to its request's entry (note_target); a dict per request, set by the middleware
_current: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("dsec_audit", default=None)


def note_target(target: str) -> None:
    """Name the target of the request being audited when its path does not (a new sandbox's id)."""
    holder = _current.get()
    if holder is not None:
        holder["target"] = target


def match(method: str, path: str) -> tuple[Rule, re.Match[str]] | None:
    for rule in _BY_METHOD.get(method, ()):
        m = rule.path.match(path)
        if m is not None:
            return rule, m
    return None


class AuditLog:
    """The apiserver's queue of entries and its writer (one per ApiContext)."""

    def __init__(self, store: AuditStore, retention_s: float):
        self.store = store
        self.retention_s = retention_s
        # hourly; a short retention (tests) is pruned within a quarter of it
        self.prune_every_s = min(PRUNE_EVERY_S, retention_s / 4)
        self.pending: list["Record | Noted"] = []
        self.dropped = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pruned = 0.0

    def note(self, record: "Record | Noted") -> None:
        self.pending.append(record)
        if len(self.pending) > MAX_PENDING:
            over = len(self.pending) - MAX_PENDING
            del self.pending[:over]
            self.dropped += over
        if len(self.pending) >= BATCH:
            self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="dsec-audit-writer")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        try:
            await self.flush()
        except Exception as e:
            log.warning("audit log: last entries not written", extra={"error": f"{type(e).__name__}: {e}",
                                                                       "entries": len(self.pending)})

    async def flush(self) -> int:
        """Write what waits now (the writer does this every FLUSH_S); how many were written."""
        batch, self.pending = self.pending, []
        if not batch:
            return 0
        try:
            return await asyncio.to_thread(self._write, batch)
        except BaseException:
            self.pending[:0] = batch      # kept for the next pass (the store may be restarting)
            raise

    def _write(self, batch: list["Record | Noted"]) -> int:
        """In the writer's thread: make the requests' entries, then write them in one transaction."""
        records = [r if isinstance(r, Record) else r.record() for r in batch]
        return self.store.add([r for r in records if r is not None])

    async def prune(self, now: float | None = None) -> int:
        return await asyncio.to_thread(self.store.prune, (now or time.time()) - self.retention_s)

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), min(FLUSH_S, self.prune_every_s))
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.flush()
                if time.monotonic() - self._pruned > self.prune_every_s:
                    self._pruned = time.monotonic()
                    await self.prune()
            except Exception as e:
                log.warning("audit log write failed; retrying", extra={"error": f"{type(e).__name__}: {e}",
                                                                       "entries": len(self.pending)})


def _token_actor(t: Any) -> Principal | None:
    """Who E2B sandbox traffic acts as: the holder of the sandbox's access token, in its project
    (t: the E2B dispatcher's resolved target)."""
    project = getattr(getattr(t, "info", None), "project", None)
    if not project:
        return None
    return Principal(project_id=project, key_id=E2B_TOKEN_ACTOR, project_name="")


def audit_log(ctx: "ApiContext") -> AuditLog:
    a = ctx.runtime.audit
    if a is None:
        a = ctx.runtime.audit = AuditLog(AuditStore(ctx.iam.db), ctx.settings.observability.audit_retention_s)
    return a


class AuditRecorder:
    """ASGI middleware, inside RequestGuard: notes each audited request when its answer starts."""

    def __init__(self, app: ASGIApp, *, ctx: "ApiContext"):
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        found = match(scope["method"], scope["path"]) if scope["type"] == "http" else None
        principal = scope.get("state", {}).get("dsec_principal") if found else None
        if found is None or not (isinstance(principal, Principal) or found[0].envd):
            await self.app(scope, receive, send)
            return
        holder: dict[str, Any] = {}
        token = _current.set(holder)
        noted = False

        def note(status: int) -> None:
            # only what the request leaves behind is kept here; the writer builds the entry
            # off the request path (Noted.record)
            nonlocal noted
            if not noted:
                noted = True
                audit_log(self.ctx).note(Noted(time.time(), found, principal, scope, status, holder))

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                note(int(message["status"]))     # when the answer starts: a long stream is logged at once
            await send(message)
        try:
            await self.app(scope, receive, noting_send)
        finally:
            _current.reset(token)
            note(500)     # no answer started (an error, a dropped connection)


class Noted:
    """An audited request as the middleware keeps it: the writer makes its Record in its
    thread, so a request pays an append (docs/decisions.md, "Audit log")."""

    __slots__ = ("at", "rule", "m", "principal", "path", "query", "e2b_target", "status", "holder")

    def __init__(self, at: float, found: tuple[Rule, re.Match[str]], principal: Any, scope: Scope, status: int,
                 holder: dict[str, Any]):
        self.at, self.principal, self.status, self.holder = at, principal, status, holder
        self.rule, self.m = found
        rule = self.rule
        # what of the scope the entry needs, not the scope (it holds the request's state)
        self.path: str = scope["path"]
        self.query: bytes = scope.get("query_string") or b""
        self.e2b_target = scope.get("state", {}).get(E2B_TARGET_KEY) if rule.envd else None

    def record(self) -> Record | None:
        who = self.principal if isinstance(self.principal, Principal) else _token_actor(self.e2b_target)
        if who is None:      # envd traffic refused before its sandbox was known: nobody to name
            return None
        rule, m, holder = self.rule, self.m, self.holder
        groups = m.groupdict()
        action = rule.action.format(**{k: (v or "").lower() for k, v in groups.items()}) if "{" in rule.action \
            else rule.action
        details: dict[str, Any] = {}
        if rule.query and self.query:
            q = parse_qs(self.query.decode("latin-1"))
            details.update({k: q[k][0][:4096] for k in rule.query if k in q})
        if groups.get("exec"):
            details["exec_id"] = groups["exec"]
        if groups.get("project"):
            details["project"] = groups["project"]
        if self.path.startswith("/e2b/"):
            details["via"] = "e2b"
        target = holder.get("target") or (getattr(self.e2b_target, "sandbox_id", "") if rule.envd else "") \
            or groups.get("target") or groups.get("project") or ""
        if details.get("via") == "e2b" and (m2 := E2B_ID.match(target)):
            target = f"sb-{m2['node']}.{m2['rand']}"     # E2B's id of a sandbox (e2b/ids.py) as dsec's
        return Record(at=self.at, project_id=who.project_id, key_id=who.key_id, action=action, target=target,
                      status=self.status, details=details)
