"""Async Python client. The blocking client (dsec.sdk.sync) is generated from this one.

    async with Client() as c:                       # embedded default: starts `dsec up` if needed
        sb = await c.create_container(ContainerArgs(image="debian-python"))
        r = await sb.run("python3 -c 'print(6*7)'")  # r.stdout == "42\\n"
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import functools
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel

from dsec import tracing
from dsec.config import DEFAULT_PORT, SERVER_INSTALL, Paths, server_installed
from dsec.sdk import lean_http
from dsec.sdk.iam_types import (KeyInfo, KeyList, NewKey, ProjectCreate, ProjectInfo, ProjectList, QuotaInfo,
                                QuotaUpdate)
from dsec.types import FnCallBatch, FnCallBatchItem, FnCallRequest, FnCallResult, FnCallStatus
from dsec.types import BulkItem, BulkResult, ExecInfo, ExecList, PackDiffRequest, PtySize
from dsec.types import MicroVMArgs, SandboxArgs, SnapshotInfo, SnapshotList, UsageList, UsageSample, VMArgs
from dsec.types import ImageBuildResult, ImageConfig, ImageProgress, ImagePullRequest
from dsec.types import ForkRequest, ForkResult
from dsec.types import VolumeCreate, VolumeEntry, VolumeEntryList, VolumeInfo, VolumeList
from dsec.types import (ERRORS_BY_CODE, SDK_KEY_PREFIX, ContainerArgs, DsecError, ExecEvent, ExecRequest, ExecResult, FsEvent,
                        FileEntry, FileList, ImageInfo, ImageList, NetworkPolicy, NodeStatus, SandboxInfo, SandboxList,
                        InvalidArgument, Unavailable, WarmPools)
from dsec.types import AuditList
from dsec.types import EventList, SandboxEvent, WebhookCreate, WebhookInfo, WebhookList, DeliveryList, ended_error

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
AUTOSTART_WAIT_S = 120.0
JSON = {"Content-Type": "application/json"}
# A connection the server closed as the request went out (its keep-alive ended, a restart):
# httpx raises one of these. GET/DELETE, and POSTs that carry an idempotency key, are sent
# again; the server answers a repeat of those as it answered the first.
RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)
RETRY_WINDOW_S = 10.0      # long enough to ride through a server restart
RETRY_BASE_S = 0.05        # first wait, doubling to at most 1 s
# A 503/429 with Retry-After is a refusal that passes (control store away, a replica swapping its
# pool, a project's create rate): repeatable calls wait what the server says and go again, at
# most BUSY_RETRIES times and busy_retry_s in all (DSEC_BUSY_RETRY_S; 0 turns it off).
BUSY_STATUSES = (429, 503)
BUSY_RETRIES = 8
BUSY_RETRY_S = 30.0
OCTETS = {"Content-Type": "application/octet-stream"}
URL_CACHE_SIZE = 1024      # parsed request URLs kept per client (Client._url)


def _raise_for(resp: httpx.Response, body: bytes) -> None:
    if resp.status_code < 400:
        return
    try:
        err = json.loads(body)["error"]
        cls = ERRORS_BY_CODE.get(err.get("code"), DsecError)
        if err.get("reason"):   # the sandbox ended: InfrastructureFailure or EndedByUser, carrying why
            e = ended_error(cls, str(err["reason"]), err.get("message", "error"), field=err.get("field"),
                            fix=err.get("fix"))
        else:
            e = cls(err.get("message", "error"), field=err.get("field"), fix=err.get("fix"))
    except (ValueError, KeyError, TypeError):
        raise DsecError(f"HTTP {resp.status_code}: {body[:500].decode(errors='replace')}") from None
    retry = resp.headers.get("retry-after", "")
    if retry.isdigit():       # a refusal that passes (429 rate/queue, 503 control store): when to retry
        e.retry_after_s = int(retry)   # type: ignore[attr-defined]
    raise e


def _busy_retry_s(given: float | None) -> float:
    if given is not None:
        value, where = given, "busy_retry_s"
    else:
        raw = os.environ.get("DSEC_BUSY_RETRY_S", "")
        try:
            value, where = (float(raw) if raw else BUSY_RETRY_S), "DSEC_BUSY_RETRY_S"
        except ValueError:
            raise InvalidArgument(f"DSEC_BUSY_RETRY_S={raw!r} is not a number of seconds", field="DSEC_BUSY_RETRY_S",
                            fix="set it to seconds (0 turns retries of 503/429 off)") from None
    if value < 0:
        raise InvalidArgument(f"{where}={value} is negative", field=where, fix="give seconds >= 0 (0: no retries)")
    return value


def _busy_delay(resp: httpx.Response) -> float | None:
    """The server's delay when `resp` is a refusal that passes (503/429 with Retry-After in
    seconds), else None."""
    if resp.status_code not in BUSY_STATUSES:
        return None
    retry = resp.headers.get("retry-after", "").strip()
    return float(retry) if retry.isdigit() else None


def _sdk_http() -> str:
    mode = os.environ.get("DSEC_SDK_HTTP") or "lean"
    if mode not in ("lean", "httpx"):
        raise InvalidArgument(f"DSEC_SDK_HTTP={mode!r} is not an HTTP mode of the SDK", field="DSEC_SDK_HTTP",
                              fix="set it to lean (its own HTTP/1.1) or httpx (httpx's transport), or unset it")
    return mode


def _extract_cookies(jar: httpx.Cookies, response: httpx.Response) -> None:
    if "set-cookie" in response.headers:
        httpx.Cookies.extract_cookies(jar, response)


def _sdk_key() -> str:
    """An idempotency key the SDK makes for a request the caller gave none (so it may be resent;
    the server keeps what such keys name only for a short while)."""
    return f"{SDK_KEY_PREFIX}{secrets.token_hex(12)}"


def wire(model: BaseModel) -> str:
    """A request body: only what differs from the defaults, and always the backend tag. A field
    a newer client has and the caller left alone then never reaches an older server (which
    refuses unknown fields): client and server can be upgraded one after the other."""
    body = model.model_dump(mode="json", exclude_defaults=True)
    if "backend" in type(model).model_fields:
        body["backend"] = getattr(model, "backend")
    return json.dumps(body)


class ExecFailed(DsecError):
    """Raised by run(check=True) when the command did not exit 0."""

    def __init__(self, result: ExecResult):
        super().__init__(f"command exited {result.exit_code} (signal {result.signal}, timed_out={result.timed_out}): "
                         f"{result.stderr[-500:]}")
        self.result = result


class Client:
    # Public attributes are declared here: the generated blocking client (dsec.sdk.sync) types
    # its own from these. `list` below shadows the builtin in this class body, hence
    # `builtins.list` in the annotations after it.
    url: str
    autostart: bool
    busy_retry_s: float

    def __init__(self, url: str | None = None, api_key: str | None = None, *, timeout_s: float = 3600.0,
                 autostart: bool | None = None, max_connections: int = 256, busy_retry_s: float | None = None):
        """`busy_retry_s`: how long in all one idempotent call may wait out 503/429 answers that
        carry Retry-After before their error is raised (default DSEC_BUSY_RETRY_S, else 30;
        0: never, the caller sees the first refusal and its `retry_after_s`)."""
        self.url = (url or os.environ.get("DSEC_URL") or DEFAULT_URL).rstrip("/")
        # Only the embedded default (no URL given anywhere) starts a local server by itself.
        self.autostart = autostart if autostart is not None else (url is None and "DSEC_URL" not in os.environ)
        self._api_key = api_key or os.environ.get("DSEC_API_KEY")
        self.busy_retry_s = _busy_retry_s(busy_retry_s)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        transport: httpx.AsyncBaseTransport = httpx.AsyncHTTPTransport(limits=limits)
        if lean_http.available() and _sdk_http() == "lean":
            transport = lean_http.LeanTransport(transport, max_connections)   # httpx's for TLS/uploads
        self._http = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                       limits=limits, transport=transport)
        # httpx hands every response to http.cookiejar (an email.message of its headers, a urllib
        # request: a fifth of the client's CPU per call, issue 29); only one that sets a cookie now
        jar = self._http.cookies
        jar.extract_cookies = functools.partial(_extract_cookies, jar)    # type: ignore[method-assign]
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._urls: dict[str, httpx.URL] = {}

    async def __aenter__(self) -> "Client":
        await self._ensure_ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def ready(self) -> None:
        """Wait until the server answers (starting the local one first with autostart). Every
        call does this itself; a caller that only wants the server up (`dsec up --background`)
        calls it alone."""
        await self._ensure_ready()

    # -- plumbing ------------------------------------------------------------------------
    async def _ensure_ready(self) -> None:
        if self._ready:
            return
        async with self._ready_lock:
            if self._ready:
                return
            if not await self._healthy():
                if not self.autostart:
                    raise Unavailable(f"no dsec apiserver at {self.url}",
                                      fix="start one with `dsec up`, or set DSEC_URL")
                await asyncio.to_thread(start_local_server, self.url)
                deadline = time.monotonic() + AUTOSTART_WAIT_S
                while not await self._healthy():
                    if time.monotonic() > deadline:
                        raise Unavailable(f"dsec apiserver did not come up at {self.url}",
                                          fix=f"see {Paths.from_env().server_log}")
                    await asyncio.sleep(0.2)
            if self._api_key is None:
                key_file = Paths.from_env().admin_key_file
                if key_file.exists():
                    self._api_key = key_file.read_text().strip()
            if self._api_key:
                self._http.headers["Authorization"] = f"Bearer {self._api_key}"
            self._ready = True

    def _url(self, path: str) -> httpx.URL:
        """The absolute URL of an API path, parsed once: httpx parses a relative path and merges
        it with the base URL on every request (a tenth of the client's CPU per `run`, issue 29);
        an absolute URL object it takes as it is. Paths repeat per sandbox (create, exec, stop)."""
        url = self._urls.get(path)
        if url is None:
            if len(self._urls) >= URL_CACHE_SIZE:
                self._urls.clear()
            url = self._urls[path] = httpx.URL(self.url + path)
        return url

    async def _healthy(self) -> bool:
        try:
            r = await self._http.get("/healthz", timeout=2.0)
            return r.status_code == 200
        except httpx.TransportError:
            return False

    async def _request(self, method: str, path: str, *, idempotent: bool = False, **kw: Any) -> httpx.Response:
        """One API call. Sent again on a lost connection when repeating it is harmless: GET and
        DELETE always, any method when `idempotent` (its body carries an idempotency key);
        others only when the connection could not be made at all."""
        await self._ensure_ready()
        repeatable = idempotent or method in ("GET", "HEAD", "DELETE")
        busy_deadline = time.monotonic() + self.busy_retry_s
        for attempt in range(BUSY_RETRIES + 1):
            resp = await self._send(method, path, repeatable, **kw)
            delay = _busy_delay(resp)
            if (not repeatable or delay is None or attempt == BUSY_RETRIES
                    or time.monotonic() + delay > busy_deadline):
                break
            await resp.aclose()
            await asyncio.sleep(delay)
        _raise_for(resp, resp.content)
        return resp

    async def _send(self, method: str, path: str, repeatable: bool, **kw: Any) -> httpx.Response:
        """One request, sent again on a lost connection (see _request)."""
        deadline = time.monotonic() + RETRY_WINDOW_S
        wait = RETRY_BASE_S
        while True:
            try:
                if tracing.on():      # the current span's traceparent (dsec.tracing; off: no cost)
                    kw["headers"] = tracing.inject(dict(kw.get("headers") or {}))
                return await self._http.request(method, self._url(path), **kw)
            except RETRYABLE as e:
                if time.monotonic() >= deadline or not (repeatable or isinstance(e, httpx.ConnectError)):
                    raise
                await asyncio.sleep(wait)
                wait = min(1.0, wait * 2)

    # -- sandboxes -----------------------------------------------------------------------
    async def create_container(self, args: ContainerArgs | None = None, **kwargs: Any) -> "Sandbox":
        """Create a container sandbox. Pass ContainerArgs, or its fields as keywords."""
        return await self.create(args if args is not None else ContainerArgs(**kwargs))

    async def create_microvm(self, args: MicroVMArgs | None = None, **kwargs: Any) -> "Sandbox":
        """Create a QEMU microvm sandbox (a clone of its environment's template by default)."""
        return await self.create(args if args is not None else MicroVMArgs(**kwargs))

    async def create_vm(self, args: VMArgs | None = None, **kwargs: Any) -> "Sandbox":
        """Create a full QEMU q35 VM sandbox (layers mapped with virtio-pmem + DAX)."""
        return await self.create(args if args is not None else VMArgs(**kwargs))

    # -- project sandbox policy (dsec.iam.policy) -----------------------------------------
    # -- egress secrets (issue 30): values go in, never out --------------------------------
    async def create_secret(self, name: str, value: str, hosts: list[str], *, header: str | None = None,
                            basic_auth: bool = False, ports: list[int] | None = None) -> dict[str, Any]:
        """Store a credential the node's egress proxy adds to requests to `hosts` (as `header`,
        or as basic auth of "user:password") from sandboxes created with secrets=[name]."""
        body: dict[str, Any] = {"name": name, "value": value, "hosts": hosts, "header": header,
                                "basic_auth": basic_auth}
        if ports is not None:
            body["ports"] = ports
        out: dict[str, Any] = (await self._request("POST", "/v1/secrets", json=body)).json()
        return out

    async def list_secrets(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = (await self._request("GET", "/v1/secrets")).json()["items"]
        return items

    async def delete_secret(self, name: str) -> dict[str, Any]:
        """Remove it; the nodes stop adding it before this returns."""
        out: dict[str, Any] = (await self._request("DELETE", f"/v1/secrets/{name}")).json()
        return out

    async def get_policy(self, project_id: str) -> dict[str, Any]:
        """{"project_id", "own", "effective"}: what the project's sandboxes may loosen."""
        resp = await self._request("GET", f"/v1/projects/{project_id}/policy")
        body: dict[str, Any] = resp.json()
        return body

    async def set_policy(self, project_id: str, policy: dict[str, Any]) -> dict[str, Any]:
        """Replace a project's own policy (key of a parent project; it may only narrow)."""
        resp = await self._request("PUT", f"/v1/projects/{project_id}/policy", json=policy)
        body: dict[str, Any] = resp.json()
        return body

    # -- operators' named network rule sets (`network.rulesets`, policy `rulesets`) --------
    async def rulesets(self) -> dict[str, Any]:
        """{"rulesets": {name: {"rules": [...], "domains": [...]}}}."""
        resp = await self._request("GET", "/v1/network/rulesets")
        body: dict[str, Any] = resp.json()
        return body

    async def set_ruleset(self, name: str, rules: list[dict[str, Any]] | None = None,
                          domains: list[str] | None = None) -> dict[str, Any]:
        """Define or replace a rule set (a key of the root project); running sandboxes that use
        it follow for new connections. The answer says, per node, how many were re-applied."""
        resp = await self._request("PUT", f"/v1/network/rulesets/{name}",
                                   json={"rules": rules or [], "domains": domains or []})
        body: dict[str, Any] = resp.json()
        return body

    async def delete_ruleset(self, name: str) -> dict[str, Any]:
        resp = await self._request("DELETE", f"/v1/network/rulesets/{name}")
        body: dict[str, Any] = resp.json()
        return body

    # -- projects, quotas and keys (nested: a key acts for its project and those below) ---
    async def projects(self) -> builtins.list[ProjectInfo]:
        """The caller's project and every project below it, top down."""
        resp = await self._request("GET", "/v1/projects")
        return ProjectList.model_validate_json(resp.content).projects

    async def create_project(self, name: str, parent_id: str | None = None, *, max_sandboxes: int | None = None,
                             max_cpu_cores: float | None = None, max_memory_mb: int | None = None) -> ProjectInfo:
        """A sub-project (default: of the caller's project); omitted quotas inherit the
        parent's, and none may exceed it."""
        req = ProjectCreate(name=name, parent_id=parent_id, max_sandboxes=max_sandboxes,
                            max_cpu_cores=max_cpu_cores, max_memory_mb=max_memory_mb)
        resp = await self._request("POST", "/v1/projects", content=wire(req), headers=JSON)
        return ProjectInfo.model_validate_json(resp.content)

    async def project(self, project_id: str) -> ProjectInfo:
        return ProjectInfo.model_validate_json((await self._request("GET", f"/v1/projects/{project_id}")).content)

    async def delete_project(self, project_id: str) -> None:
        """Remove an empty project (no sub-projects, no sandboxes)."""
        await self._request("DELETE", f"/v1/projects/{project_id}")

    async def quota(self, project_id: str) -> QuotaInfo:
        """The project's limits and what it and its sub-projects hold now."""
        return QuotaInfo.model_validate_json((await self._request("GET", f"/v1/projects/{project_id}/quota")).content)

    async def set_quota(self, project_id: str, *, max_sandboxes: int | None = None,
                        max_cpu_cores: float | None = None, max_memory_mb: int | None = None) -> QuotaInfo:
        """Change a sub-project's quota (key of a parent project; within the parent's)."""
        req = QuotaUpdate(max_sandboxes=max_sandboxes, max_cpu_cores=max_cpu_cores, max_memory_mb=max_memory_mb)
        resp = await self._request("PUT", f"/v1/projects/{project_id}/quota", content=wire(req), headers=JSON)
        return QuotaInfo.model_validate_json(resp.content)

    async def keys(self, project_id: str) -> builtins.list[KeyInfo]:
        return KeyList.model_validate_json((await self._request("GET", f"/v1/projects/{project_id}/keys")).content).keys

    async def create_key(self, project_id: str, role: str = "admin") -> NewKey:
        """A new API key of the project: `.key` is the secret, shown this once. `role`: admin
        (manages keys, reads the audit log) or member (uses sandboxes only)."""
        return NewKey.model_validate_json((await self._request(
            "POST", f"/v1/projects/{project_id}/keys", params={"role": role})).content)

    async def audit(self, *, project: str | None = None, key_id: str | None = None, action: str | None = None,
                    target: str | None = None, since: datetime | None = None, until: datetime | None = None,
                    before: str | None = None, limit: int = 100) -> AuditList:
        """The audit log, newest first (an admin key: its project's and those below it).
        `action`: exact (`exec.start`) or a prefix ending in a dot (`file.`); pass the answer's
        next_before as `before` for the next page."""
        params: dict[str, Any] = {"limit": limit}
        for k, v in (("project", project), ("key_id", key_id), ("action", action), ("target", target),
                     ("before", before), ("since", since.isoformat() if since else None),
                     ("until", until.isoformat() if until else None)):
            if v is not None:
                params[k] = v
        return AuditList.model_validate_json((await self._request("GET", "/v1/audit", params=params)).content)

    async def revoke_key(self, key_id: str) -> None:
        await self._request("DELETE", f"/v1/keys/{key_id}")

    async def rotate_key(self, key_id: str = "self", *, grace_s: float = 3600.0) -> NewKey:
        """Replace key `key_id` ("self": the one this client uses) without downtime: a new key
        of the same project (`.key`, shown this once); the old one works for `grace_s` more
        seconds (0: ends now), so clients can switch over."""
        resp = await self._request("POST", f"/v1/keys/{key_id}/rotate", params={"grace_s": grace_s})
        return NewKey.model_validate_json(resp.content)

    async def create(self, args: SandboxArgs) -> "Sandbox":
        """Create a sandbox of the backend its argument type names. Without an idempotency_key
        one is made here, so a retry after a lost connection cannot create a second sandbox."""
        if args.idempotency_key is None:
            args = args.model_copy(update={"idempotency_key": _sdk_key()})
        if not tracing.on():
            resp = await self._request("POST", "/v1/sandboxes", content=wire(args), headers=JSON, idempotent=True)
            return Sandbox(self, SandboxInfo.model_validate_json(resp.content))
        with tracing.span("dsec.sandbox.create", "client", {"dsec.backend": args.backend}) as span:
            resp = await self._request("POST", "/v1/sandboxes", content=wire(args), headers=JSON, idempotent=True)
            info = SandboxInfo.model_validate_json(resp.content)
            tracing.set_attrs(span, {"dsec.sandbox_id": info.id})
            return Sandbox(self, info)

    async def create_many(self, n: int, args: SandboxArgs, *, concurrency: int = 32
                          ) -> AsyncIterator["Created"]:
        """Create n sandboxes; yield each as soon as it is ready (or failed), in completion order.

        Failures are reported per sandbox, never as one exception for the burst. If the caller
        stops iterating early, creations still in flight are awaited and their sandboxes stopped.
        """
        sem = asyncio.Semaphore(concurrency)
        abandoned = False

        async def one(i: int) -> Created:
            async with sem:
                if abandoned:
                    return Created(i, None, DsecError("not created: the caller stopped iterating"))
                try:
                    return Created(i, await self.create(args), None)
                except DsecError as e:
                    return Created(i, None, e)
                except httpx.HTTPError as e:
                    return Created(i, None, Unavailable(f"request failed: {e}"))

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        handed_out: set[int] = set()
        try:
            for fut in asyncio.as_completed(tasks):
                res = await fut
                handed_out.add(res.index)
                yield res
        finally:
            # Structured: nothing outlives the burst. Creations already sent are awaited (a
            # cancelled request could still create a sandbox server-side) and stopped if the
            # caller never received them; queued ones are skipped.
            abandoned = True
            for done in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(done, Created) and done.index not in handed_out and done.sandbox:
                    await done.sandbox.stop()

    async def suspend_all(self, labels: dict[str, str]) -> builtins.list[BulkItem]:
        """Park every one of your sandboxes that has all of `labels` (e.g. on trainer
        preemption); each one's outcome. They resume on their next request, or resume_all()."""
        resp = await self._request("POST", "/v1/sandboxes/bulk/suspend", content=json.dumps({"labels": labels}),
                                   headers=JSON)
        return BulkResult.model_validate_json(resp.content).sandboxes

    async def resume_all(self, labels: dict[str, str]) -> builtins.list[BulkItem]:
        resp = await self._request("POST", "/v1/sandboxes/bulk/resume", content=json.dumps({"labels": labels}),
                                   headers=JSON)
        return BulkResult.model_validate_json(resp.content).sandboxes

    async def get(self, sandbox_id: str) -> "Sandbox":
        resp = await self._request("GET", f"/v1/sandboxes/{sandbox_id}")
        return Sandbox(self, SandboxInfo.model_validate_json(resp.content))

    async def list(self, include_ended: bool = False) -> list[SandboxInfo]:
        return (await self.listing(include_ended)).sandboxes

    async def listing(self, include_ended: bool = False, *, project: str | None = None,
                      labels: dict[str, str] | None = None, states: Iterable[str] = (),
                      limit: int | None = None, offset: int = 0) -> SandboxList:
        """The listing with `unreachable_nodes`: nodes that did not answer, whose sandboxes are
        shown as last known. With a filter (project, all of `labels`, any of `states`) or a
        page (`limit`, `offset`): newest first, `total` counting the matches, `next_offset` the
        next page's offset (None: the last page)."""
        params: list[tuple[str, str | int | bool]] = [("include_ended", include_ended)]
        params += [("project", project)] if project else []
        params += [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        params += [("state", str(getattr(s, "value", s))) for s in states]
        params += ([("limit", limit)] if limit is not None else []) + ([("offset", offset)] if offset else [])
        resp = await self._request("GET", "/v1/sandboxes", params=tuple(params))
        return SandboxList.model_validate_json(resp.content)

    async def nodes(self) -> builtins.list[NodeStatus]:
        resp = await self._request("GET", "/v1/nodes")
        return [NodeStatus.model_validate(n) for n in resp.json()]

    async def node_action(self, node: str, action: str, stop: bool = False) -> dict[str, Any]:
        """Admin only: `cordon`, `drain`, `uncordon` or `forget` a node (`dsec nodes`); the
        answer names its state, a drain's remaining sandboxes, a forget's released quota.
        stop=True (drain): also stop its sandboxes, each ending `preempted` (answer: `stopped`)."""
        resp = await self._request("POST", f"/v1/nodes/{node}/{action}", params={"stop": "true"} if stop else None)
        answer: dict[str, Any] = resp.json()
        return answer

    async def warm_pools(self, node: str = "local") -> WarmPools:
        """Admin only: a node's warm pools (D28): per image its size, idle and starting
        sandboxes and last start error; the creates they answered (`claims`) and missed."""
        resp = await self._request("GET", f"/v1/nodes/{node}/warm-pool")
        return WarmPools.model_validate_json(resp.content)

    async def set_warm_pools(self, pools: str | None, node: str = "local", auto: int | None = None) -> WarmPools:
        """Admin only: set a node's warm pools, 'image:size,...' (e.g. 'debian-python:8,busybox:4';
        '' for none; None: unchanged), as DSEC_WARM_POOL does at its start, and with `auto` the
        bound on the pools the node keeps on its own (DSEC_WARM_POOL_AUTO; 0: none). The node
        refills or drains them in the background: the answer is their state now (`WarmPool.full`
        once filled; automatic pools under `auto`)."""
        body: dict[str, Any] = {"pools": pools}
        if auto is not None:
            body["auto"] = auto
        resp = await self._request("PUT", f"/v1/nodes/{node}/warm-pool", json=body)
        return WarmPools.model_validate_json(resp.content)

    async def images(self) -> builtins.list[ImageInfo]:
        resp = await self._request("GET", "/v1/images")
        return ImageList.model_validate_json(resp.content).images

    async def publish_image(self, name: str) -> ImageInfo:
        """Admin only: make an image or layer usable by every project."""
        resp = await self._request("POST", f"/v1/images/{name}/publish")
        return ImageInfo.model_validate_json(resp.content)

    async def build_image(self, name: str, context: str | os.PathLike[str], *, dockerfile: str = "Dockerfile",
                          replace: bool = False, network: bool = False, memory_mb: int | None = None,
                          timeout_s: float = 1800, on_progress: Callable[[ImageProgress], None] | None = None
                          ) -> ImageBuildResult:
        """Build the Dockerfile in directory `context` on the server (buildah; FROM names a dsec
        image). RUN steps have no network (the server refuses `network`, D45) and `memory_mb`
        (default 2048, never above the project's policy or quota). `on_progress` gets every
        progress line. Returns the image and its config (env, workdir, ...)."""
        from dsec.sdk.image_upload import tar_dir
        params: dict[str, Any] = {"name": name, "dockerfile": dockerfile, "replace": replace, "network": network,
                                  "timeout_s": timeout_s}
        if memory_mb is not None:
            params["memory_mb"] = memory_mb
        with tar_dir(context, "context") as tar:
            return await self._image_stream("/v1/images/build", params, tar, on_progress)

    async def import_image(self, name: str, *, oci: str | os.PathLike[str] | None = None,
                           docker_archive: str | os.PathLike[str] | None = None, ref: str | None = None,
                           replace: bool = False, on_progress: Callable[[ImageProgress], None] | None = None
                           ) -> ImageInfo:
        """Upload and import an OCI layout directory or a `docker save` tar as image NAME."""
        from dsec.sdk.image_upload import tar_dir
        if (oci is None) == (docker_archive is None):
            raise DsecError("give exactly one of oci and docker_archive", field="source",
                            fix="pass an OCI layout dir (oci=) or a docker-archive tar")
        params: dict[str, Any] = {"name": name, "replace": replace,
                                  "format": "oci" if oci is not None else "docker-archive"}
        if ref is not None:
            params["ref"] = ref
        if oci is not None:
            with tar_dir(oci, "oci") as tar:
                return (await self._image_stream("/v1/images/import", params, tar, on_progress)).image
        with open(docker_archive, "rb") as f:   # type: ignore[arg-type]
            return (await self._image_stream("/v1/images/import", params, f, on_progress)).image

    async def pull_image(self, name: str, ref: str, *, tls_verify: bool = True, creds: str | None = None,
                         replace: bool = False, on_progress: Callable[[ImageProgress], None] | None = None
                         ) -> ImageInfo:
        """Admin only: the server pulls `ref` (docker://HOST/REPO:TAG) and imports it as NAME."""
        body = ImagePullRequest(name=name, ref=ref, tls_verify=tls_verify, creds=creds, replace=replace)
        return (await self._image_stream("/v1/images/pull", {}, None, on_progress, wire(body))).image

    async def image_config(self, name: str) -> ImageConfig:
        """ENV/WORKDIR/USER/CMD a Dockerfile gave image NAME (empty for other images)."""
        resp = await self._request("GET", f"/v1/images/{name}/config")
        return ImageConfig.model_validate_json(resp.content)

    async def _image_stream(self, path: str, params: dict[str, Any], body: IO[bytes] | None,
                            on_progress: Callable[[ImageProgress], None] | None,
                            json_body: str | None = None) -> ImageBuildResult:
        await self._ensure_ready()
        content: Any = json_body
        headers = JSON
        if body is not None:
            headers = OCTETS

            async def chunks() -> AsyncIterator[bytes]:
                while chunk := body.read(1 << 20):
                    yield chunk
            content = chunks()
        async with self._http.stream("POST", path, params=params, content=content, headers=headers,
                                     timeout=httpx.Timeout(30.0, read=None)) as resp:
            if resp.status_code >= 400:
                _raise_for(resp, await resp.aread())
            async for line in resp.aiter_lines():
                if not line:
                    continue
                ev = ImageProgress.model_validate_json(line)
                if ev.error is not None:
                    cls = ERRORS_BY_CODE.get(ev.error.code, DsecError)
                    raise cls(ev.error.message, field=ev.error.field, fix=ev.error.fix)
                if ev.result is not None:
                    return ev.result
                if on_progress is not None:
                    on_progress(ev)
        raise DsecError(f"the server ended {path} without a result", fix="see the server log; retry")

    # -- VM snapshots (taken with Sandbox.snapshot()) ------------------------------------
    async def snapshots(self) -> builtins.list[SnapshotInfo]:
        """Snapshots of this key's project and its sub-projects."""
        resp = await self._request("GET", "/v1/snapshots")
        return SnapshotList.model_validate_json(resp.content).snapshots

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        resp = await self._request("GET", f"/v1/snapshots/{snapshot_id}")
        return SnapshotInfo.model_validate_json(resp.content)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Free its disk; sandboxes restored from it keep working."""
        await self._request("DELETE", f"/v1/snapshots/{snapshot_id}")

    # -- volumes (mounted with create_container(..., volumes=[{"name", "path", "read_only"}])) --
    async def create_volume(self, name: str, size_mb: int = 1024) -> VolumeInfo:
        """A named, persistent directory of this key's project, quota size_mb MiB."""
        resp = await self._request("POST", "/v1/volumes",
                                   content=VolumeCreate(name=name, size_mb=size_mb).model_dump_json(), headers=JSON)
        return VolumeInfo.model_validate_json(resp.content)

    async def volumes(self, usage: bool = False) -> builtins.list[VolumeInfo]:
        """This project's volumes; usage=True also measures what each holds."""
        resp = await self._request("GET", "/v1/volumes", params={"usage": "true"} if usage else None)
        return VolumeList.model_validate_json(resp.content).volumes

    async def delete_volume(self, name: str) -> None:
        """Delete it and its files (refused while a sandbox mounts it)."""
        await self._request("DELETE", f"/v1/volumes/{name}")

    # the volume's files, without a sandbox (no link is followed; the byte quota holds)
    async def volume_read(self, name: str, path: str) -> bytes:
        return (await self._request("GET", f"/v1/volumes/{name}/file", params={"path": path})).content

    async def volume_write(self, name: str, path: str, data: bytes | str, *, mode: int | None = None,
                           uid: int | None = None, gid: int | None = None) -> VolumeEntry:
        """Write a whole file (parents made); owned by uid/gid 1000 (the default user) unless named."""
        params: dict[str, Any] = {"path": path, **{k: v for k, v in (("mode", mode), ("uid", uid), ("gid", gid))
                                                   if v is not None}}
        resp = await self._request("PUT", f"/v1/volumes/{name}/file", params=params,
                                   content=data.encode() if isinstance(data, str) else data, headers=OCTETS)
        return VolumeEntry.model_validate_json(resp.content)

    async def volume_ls(self, name: str, path: str = "/", depth: int = 1) -> builtins.list[VolumeEntry]:
        resp = await self._request("GET", f"/v1/volumes/{name}/dir", params={"path": path, "depth": depth})
        return VolumeEntryList.model_validate_json(resp.content).entries

    async def volume_mkdir(self, name: str, path: str, *, parents: bool = False) -> VolumeEntry:
        resp = await self._request("POST", f"/v1/volumes/{name}/dir", params={"path": path, "parents": parents})
        return VolumeEntry.model_validate_json(resp.content)

    async def volume_remove(self, name: str, path: str) -> None:
        """A file, a link, or a directory with what it holds."""
        await self._request("DELETE", f"/v1/volumes/{name}/file", params={"path": path})

    # -- lifecycle events and webhooks (docs/events.md) ------------------------------------
    async def events(self, after: int = 0, *, sandbox_id: str | None = None, limit: int = 500) -> EventList:
        """Lifecycle events with an id above `after`, oldest first (this key's projects; an
        admin key's: all). Pass the answer's last_id as `after` for the next page."""
        params: dict[str, Any] = {"after": after, "limit": limit}
        if sandbox_id is not None:
            params["sandbox_id"] = sandbox_id
        resp = await self._request("GET", "/v1/events", params=params)
        return EventList.model_validate_json(resp.content)

    async def follow_events(self, after: int = 0, *, sandbox_id: str | None = None) -> AsyncIterator[SandboxEvent]:
        """Lifecycle events after `after` as they come (an NDJSON stream; resume a broken one
        with the last id seen)."""
        await self._ensure_ready()
        params: dict[str, Any] = {"after": after, "follow": "true"}
        if sandbox_id is not None:
            params["sandbox_id"] = sandbox_id
        async with self._http.stream("GET", "/v1/events", params=params, timeout=None) as resp:
            if resp.status_code >= 400:
                _raise_for(resp, await resp.aread())
            async for line in resp.aiter_lines():
                if line.strip():
                    yield SandboxEvent.model_validate_json(line)

    async def add_webhook(self, url: str, *, events: builtins.list[str] | None = None, secret: str | None = None,
                          name: str = "", project: str | None = None) -> WebhookInfo:
        """POST this project's lifecycle events to `url`, signed with `secret` (made and
        returned once when left out): header dsec-signature: v1=HMAC-SHA256(secret, ts + "." + body)."""
        req = WebhookCreate.model_validate({"url": url, "events": events, "secret": secret, "name": name,
                                            "project": project})
        resp = await self._request("POST", "/v1/webhooks", content=req.model_dump_json(exclude_none=True),
                                   headers=JSON)
        return WebhookInfo.model_validate_json(resp.content)

    async def webhooks(self) -> builtins.list[WebhookInfo]:
        resp = await self._request("GET", "/v1/webhooks")
        return WebhookList.model_validate_json(resp.content).webhooks

    async def remove_webhook(self, webhook_id: str) -> None:
        await self._request("DELETE", f"/v1/webhooks/{webhook_id}")

    async def webhook_deliveries(self, webhook_id: str, limit: int = 100) -> DeliveryList:
        """The webhook's latest deliveries and how many are pending, delivered, failed."""
        resp = await self._request("GET", f"/v1/webhooks/{webhook_id}/deliveries", params={"limit": limit})
        return DeliveryList.model_validate_json(resp.content)

    # -- fncall: short stateless code in warm pool containers ----------------------------
    async def fncall(self, code: str | FnCallRequest, language: str = "python", *, stdin: str | None = None,
                     files: dict[str, str | bytes] | None = None, timeout_s: float = 10.0,
                     memory_mb: int | None = None, **kwargs: Any) -> FnCallResult:
        """Run one short program in a warm container and return its result (never raises for
        what the program does: see result.status). Other FnCallRequest fields as keywords:
        compile_timeout_s, args, env, fetch_files, output_cap_bytes, max_processes, image, ...

            r = await c.fncall("print(input()[::-1])", stdin="abc")     # r.stdout == "cba\\n"
        """
        req = code if isinstance(code, FnCallRequest) else fncall_request(
            code, language, stdin=stdin, files=files, timeout_s=timeout_s, memory_mb=memory_mb, **kwargs)
        resp = await self._request("POST", "/v1/fncall", content=wire(req), headers=JSON)
        return FnCallResult.model_validate_json(resp.content)

    async def fncall_pools(self) -> builtins.list[dict[str, Any]]:
        """The FnCall backend's warm pools on every node (workers, idle, starting, waiting, calls)."""
        pools: builtins.list[dict[str, Any]] = (await self._request("GET", "/v1/fncall/pools")).json()
        return pools

    async def fncall_many(self, calls: Iterable[FnCallRequest | dict[str, Any]], *, concurrency: int = 64,
                          batch_size: int | None = None) -> builtins.list[FnCallResult]:
        """Run many calls with at most `concurrency` in flight; results[i] belongs to calls[i].

        Calls are sent in batches (NDJSON answers, each call's result as soon as it is ready).
        Failures are per call (status sandbox-error with .error), never one exception: an
        invalid call, or a batch whose request failed, only marks its own calls.
        """
        items = list(calls)
        results: list[FnCallResult | None] = [None] * len(items)
        valid: list[int] = []
        reqs: dict[int, FnCallRequest] = {}
        for i, c in enumerate(items):
            try:
                reqs[i] = c if isinstance(c, FnCallRequest) else fncall_request(**c)
                valid.append(i)
            except (ValueError, TypeError, DsecError) as e:
                results[i] = _fncall_failed(c, f"invalid call: {e}")
        size = batch_size or max(1, min(64, concurrency // 4))
        chunks = iter([valid[k:k + size] for k in range(0, len(valid), size)])

        async def stream_chunks() -> None:
            for chunk in chunks:
                body = wire(FnCallBatch(calls=[reqs[i] for i in chunk]))
                try:
                    await self._ensure_ready()
                    async with self._http.stream("POST", "/v1/fncall/batch", content=body, headers=JSON) as resp:
                        if resp.status_code >= 400:
                            _raise_for(resp, await resp.aread())
                        async for line in resp.aiter_lines():
                            if line:
                                item = FnCallBatchItem.model_validate_json(line)
                                results[chunk[item.index]] = item.result
                except (DsecError, httpx.HTTPError, ValueError) as e:
                    for i in chunk:
                        if results[i] is None:
                            results[i] = _fncall_failed(reqs[i], f"batch request failed: {e}")
                for i in chunk:
                    if results[i] is None:
                        results[i] = _fncall_failed(reqs[i], "the server ended the batch without this result")

        await asyncio.gather(*(stream_chunks() for _ in range(max(1, concurrency // size))))
        return [r if r is not None else _fncall_failed(items[i], "no result") for i, r in enumerate(results)]


@dataclass
class Created:
    """One outcome of create_many: a ready sandbox, or the error for that one creation."""

    index: int
    sandbox: "Sandbox | None"
    error: DsecError | None

    @property
    def ok(self) -> bool:
        return self.sandbox is not None


@dataclass
class Forked:
    """What Sandbox.fork() made: one outcome per fork (in order), and what the forks do not
    have of their parent (containers: its running processes)."""

    not_carried: builtins.list[str]
    forks: builtins.list[Created]

    @property
    def sandboxes(self) -> builtins.list["Sandbox"]:
        """The forks that started."""
        return [c.sandbox for c in self.forks if c.sandbox is not None]


class Sandbox:
    info: SandboxInfo   # as of the last call that returned it (refresh() reads it again)
    files: Files

    def __init__(self, client: Client, info: SandboxInfo):
        self._c = client
        self.info = info
        self.files = Files(self)

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, state={self.info.state.value})"

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def _base(self) -> str:
        return f"/v1/sandboxes/{self.id}"

    async def run(self, cmd: str, *, session: str | None = None, timeout_s: float = 300.0,
                  cwd: str | None = None, env: dict[str, str] | None = None, stdin: str | None = None,
                  user: str | None = None, output_cap_bytes: int | None = None, check: bool = False,
                  idempotency_key: str | None = None) -> ExecResult:
        """Run `cmd` (a shell command line) and return its result. With `idempotency_key`, a
        retry after a timeout or lost connection returns the first run's result: the command
        runs once. Without one the SDK makes one for its own resends (a connection lost while
        the server answers is resent; the command still runs once)."""
        req = ExecRequest(cmd=cmd, session=session, timeout_s=timeout_s, cwd=cwd, env=env or {},
                          stdin=stdin, user=user, output_cap_bytes=output_cap_bytes,
                          idempotency_key=idempotency_key or _sdk_key())
        if tracing.on():
            with tracing.span("dsec.sandbox.exec", "client", {"dsec.sandbox_id": self.id}) as span:
                resp = await self._c._request("POST", f"{self._base}/exec", content=wire(req), headers=JSON,
                                              idempotent=True)
                tracing.set_attrs(span, {"dsec.exit_code": ExecResult.model_validate_json(resp.content).exit_code})
        else:
            resp = await self._c._request("POST", f"{self._base}/exec", content=wire(req), headers=JSON,
                                          idempotent=True)
        result = ExecResult.model_validate_json(resp.content)
        if check and result.exit_code != 0:
            raise ExecFailed(result)
        return result

    async def stream(self, cmd: str, *, session: str | None = None, timeout_s: float = 300.0,
                     cwd: str | None = None, env: dict[str, str] | None = None, stdin: str | None = None,
                     user: str | None = None, output_cap_bytes: int | None = None,
                     idempotency_key: str | None = None) -> AsyncIterator[ExecEvent]:
        """Yield ExecEvents as the command produces output; the last one has type 'exit' and .result."""
        req = ExecRequest(cmd=cmd, session=session, timeout_s=timeout_s, cwd=cwd, env=env or {},
                          stdin=stdin, user=user, output_cap_bytes=output_cap_bytes, idempotency_key=idempotency_key)
        path = f"{self._base}/exec/stream"
        events = self._traced_ndjson("dsec.sandbox.exec_stream", "POST", path, wire(req)) if tracing.on() \
            else self._ndjson("POST", path, wire(req))
        async for ev in events:
            yield ev

    async def _traced_ndjson(self, name: str, method: str, path: str, content: str | None = None,
                             attrs: dict[str, Any] | None = None) -> AsyncIterator[ExecEvent]:
        """_ndjson inside a CLIENT span `name` from the request to the stream's end, its
        traceparent sent (dsec.tracing: callers use it only when on())."""
        span = tracing.open_span(name, "client", {"dsec.sandbox_id": self.id, **(attrs or {})})
        failed: BaseException | None = None
        try:
            async for ev in self._ndjson(method, path, content, span=span):
                if ev.type == "exit" and ev.result is not None:
                    tracing.set_attrs(span, {"dsec.exit_code": ev.result.exit_code})
                yield ev
        except BaseException as e:
            failed = e
            raise
        finally:
            tracing.close_span(span, error=failed)

    async def _ndjson(self, method: str, path: str, content: str | None = None,
                      span: Any = None) -> AsyncIterator[ExecEvent]:
        await self._c._ensure_ready()
        headers = tracing.inject_span(dict(JSON), span) if span is not None else \
            tracing.inject(dict(JSON)) if tracing.on() else JSON
        async with self._c._http.stream(method, path, content=content, headers=headers) as resp:
            if resp.status_code >= 400:
                _raise_for(resp, await resp.aread())
            async for line in resp.aiter_lines():
                if line:
                    data = json.loads(line)
                    if isinstance(data.get("result"), dict):   # older servers left out a null
                        data["result"].setdefault("exit_code", None)   # exit_code (killed by a signal)
                    ev = ExecEvent.model_validate(data)
                    if ev.type == "exit" and ev.result is None:
                        raise DsecError(ev.data or "exec stream ended with an error")
                    yield ev

    async def start(self, cmd: str, *, session: str | None = None, timeout_s: float = 300.0,
                    cwd: str | None = None, env: dict[str, str] | None = None, stdin: str | None = None,
                    keep_stdin: bool = False, tag: str | None = None, user: str | None = None,
                    output_cap_bytes: int | None = None, idempotency_key: str | None = None) -> ExecInfo:
        """Start `cmd` detached and return at once (ExecInfo.exec_id). Then: follow(exec_id)
        for its output from the beginning, attach(exec_id) for its result, send_stdin (with
        keep_stdin=True), signal, execs() to list what runs."""
        req = ExecRequest(cmd=cmd, session=session, timeout_s=timeout_s, cwd=cwd, env=env or {}, stdin=stdin,
                          keep_stdin=keep_stdin, tag=tag, user=user, output_cap_bytes=output_cap_bytes,
                          idempotency_key=idempotency_key or _sdk_key())     # resent like run()
        resp = await self._c._request("POST", f"{self._base}/execs", content=wire(req), headers=JSON, idempotent=True)
        return ExecInfo.model_validate_json(resp.content)

    async def follow(self, exec_id: str) -> AsyncIterator[ExecEvent]:
        """An exec's output from its beginning, then live; the last event is its exit."""
        path = f"{self._base}/execs/{exec_id}/stream"
        events = self._traced_ndjson("dsec.sandbox.exec_follow", "GET", path, attrs={"dsec.exec_id": exec_id}) \
            if tracing.on() else self._ndjson("GET", path)
        async for ev in events:
            yield ev

    async def send_stdin(self, exec_id: str, data: bytes | str, *, close: bool = False) -> None:
        """Write to the stdin of a command started with keep_stdin=True; close=True closes it after."""
        body = data.encode() if isinstance(data, str) else data
        await self._c._request("POST", f"{self._base}/execs/{exec_id}/stdin", content=body,
                               params={"close": "true" if close else "false"})

    async def signal(self, exec_id: str, signal: int = 15) -> None:
        """Send `signal` (default TERM) to a running command's process group."""
        await self._c._request("POST", f"{self._base}/execs/{exec_id}/signal",
                               content=json.dumps({"signal": signal}), headers=JSON)

    async def pty(self, cmd: str | None = None, *, cols: int = 80, rows: int = 24,
                  env: dict[str, str] | None = None, cwd: str | None = None, user: str | None = None,
                  timeout_s: float = 3600.0) -> Pty:
        """Start `cmd` (default: an interactive bash, or sh where the image has no bash) on a
        terminal of cols x rows. The handle types into it (send), resizes it, signals it, yields
        its output bytes (output()) and waits for its end (wait())."""
        req = ExecRequest(cmd=cmd or PTY_SHELL, timeout_s=timeout_s, cwd=cwd, env=env or {}, user=user,
                          pty=PtySize(cols=cols, rows=rows), idempotency_key=_sdk_key())
        resp = await self._c._request("POST", f"{self._base}/execs", content=wire(req), headers=JSON, idempotent=True)
        return Pty(self, ExecInfo.model_validate_json(resp.content))

    async def resize(self, exec_id: str, cols: int, rows: int) -> None:
        """New size of a PTY exec's terminal (its programs get SIGWINCH)."""
        await self._c._request("POST", f"{self._base}/execs/{exec_id}/resize",
                               content=json.dumps({"cols": cols, "rows": rows}), headers=JSON)

    async def execs(self) -> builtins.list[ExecInfo]:
        """The commands running in the sandbox now."""
        resp = await self._c._request("GET", f"{self._base}/execs")
        return ExecList.model_validate_json(resp.content).execs

    async def attach(self, exec_id: str) -> ExecResult:
        """Wait for and return the result of an earlier exec (survives client and edge restarts)."""
        if tracing.on():
            with tracing.span("dsec.sandbox.attach", "client", {"dsec.sandbox_id": self.id,
                                                                "dsec.exec_id": exec_id}) as span:
                resp = await self._c._request("GET", f"{self._base}/execs/{exec_id}")
                result = ExecResult.model_validate_json(resp.content)
                tracing.set_attrs(span, {"dsec.exit_code": result.exit_code})
                return result
        resp = await self._c._request("GET", f"{self._base}/execs/{exec_id}")
        return ExecResult.model_validate_json(resp.content)

    async def set_timeout(self, timeout_s: float) -> SandboxInfo:
        """End the sandbox `timeout_s` seconds from now, busy or not (its absolute lifetime)."""
        resp = await self._c._request("POST", f"{self._base}/timeout", content=json.dumps({"timeout_s": timeout_s}),
                                      headers=JSON)
        self.info = SandboxInfo.model_validate_json(resp.content)
        return self.info

    async def close_session(self, name: str) -> None:
        await self._c._request("DELETE", f"{self._base}/sessions/{name}")

    async def refresh(self) -> SandboxInfo:
        resp = await self._c._request("GET", self._base)
        self.info = SandboxInfo.model_validate_json(resp.content)
        return self.info

    async def set_network(self, policy: NetworkPolicy | dict[str, Any] | None = None, **kwargs: Any) -> SandboxInfo:
        """Replace the sandbox's egress policy, e.g.
        `await sb.set_network(rules=[{"cidr": "10.1.2.3", "ports": [443], "protocol": "tcp"}])`,
        `await sb.set_network(rulesets={"pypi": True})`,
        `await sb.set_network(domains=["pypi.org", "*.pythonhosted.org"])` (TCP 80/443 by name, DNS
        for those names only); `set_network()` denies everything again. New connections follow at once."""
        if policy is None:
            policy = NetworkPolicy(**kwargs)
        elif isinstance(policy, dict):
            policy = NetworkPolicy.model_validate(policy)
        resp = await self._c._request("PUT", f"{self._base}/network", content=wire(policy), headers=JSON)
        self.info = SandboxInfo.model_validate_json(resp.content)
        return self.info

    async def pack_diff(self, name: str, *, scrub: list[str] | None = None,
                        replace: bool = False) -> ImageInfo:
        """Snapshot this sandbox's changes as workspace layer `name` ('NAME@VERSION'); start
        new sandboxes from it with create_container(..., workspace=name). `scrub`: paths
        left out (default dsec.types.DEFAULT_SCRUB: /tmp, caches, shell history)."""
        req = PackDiffRequest(name=name, scrub=scrub, replace=replace)
        resp = await self._c._request("POST", f"{self._base}/pack_diff",
                                      content=wire(req), headers=JSON)
        return ImageInfo.model_validate_json(resp.content)

    async def metrics(self, start: float | None = None, end: float | None = None) -> builtins.list[UsageSample]:
        """The sandbox's usage samples (CPU, memory used/limit, disk used/limit, network bytes),
        oldest first, optionally between `start` and `end` (Unix seconds). Asking makes the node
        sample it every 5 s for the next minute (else every 60 s); it keeps the last 720."""
        params = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
        resp = await self._c._request("GET", f"/v1/sandboxes/{self.id}/metrics", params=params)
        return UsageList.model_validate_json(resp.content).samples

    async def console(self, tail: int = 65536) -> str:
        """VM sandboxes: the end of the guest's serial console (also after it failed)."""
        resp = await self._c._request("GET", f"/v1/sandboxes/{self.id}/console", params={"tail": tail})
        return resp.content.decode(errors="replace")

    async def suspend(self) -> SandboxInfo:
        """Park the sandbox: nothing in it runs and its memory is freed (a VM is saved to disk, a
        container is frozen and its memory pushed to compressed swap). The next request resumes
        it, with its processes where they were; `resume()` does it explicitly."""
        resp = await self._c._request("POST", f"/v1/sandboxes/{self.id}/suspend")
        self.info = SandboxInfo.model_validate_json(resp.content)
        return self.info

    async def resume(self) -> SandboxInfo:
        resp = await self._c._request("POST", f"/v1/sandboxes/{self.id}/resume")
        self.info = SandboxInfo.model_validate_json(resp.content)
        return self.info

    async def snapshot(self) -> SnapshotInfo:
        """Save this sandbox's state as a snapshot of the project: VMs memory, devices and disk,
        containers their filesystem (copy-on-write); `create_*(..., snapshot=s.id)` makes new
        sandboxes of it, as many times as wanted."""
        resp = await self._c._request("POST", f"/v1/sandboxes/{self.id}/snapshot")
        return SnapshotInfo.model_validate_json(resp.content)

    async def fork(self, count: int = 1, *, lifetime_s: int | None = None) -> Forked:
        """Branch this running sandbox into `count` new ones from one snapshot taken now (it
        runs on unchanged). Each fork starts or fails on its own (its error in its Created);
        containers carry the filesystem, env, workdir, labels, limits and network policy, not
        the running processes (`not_carried` says so)."""
        body = ForkRequest(count=count, lifetime_s=lifetime_s)
        resp = await self._c._request("POST", f"/v1/sandboxes/{self.id}/fork", content=wire(body), headers=JSON)
        res = ForkResult.model_validate_json(resp.content)
        out = []
        for i, item in enumerate(res.forks):
            if item.sandbox is not None:
                out.append(Created(i, Sandbox(self._c, item.sandbox), None))
            else:
                e = item.error
                cls = ERRORS_BY_CODE.get(e.code, DsecError) if e is not None else DsecError
                out.append(Created(i, None, cls(e.message if e else "fork failed", field=e.field if e else None,
                                                fix=e.fix if e else None)))
        return Forked(res.not_carried, out)

    async def stop(self) -> SandboxInfo:
        resp = await self._c._request("DELETE", self._base)
        self.info = SandboxInfo.model_validate_json(resp.content)
        return self.info


PTY_SHELL = "if command -v bash >/dev/null 2>&1; then exec bash -i; else exec sh -i; fi"


class Pty:
    """A command on a terminal (Sandbox.pty)."""
    info: ExecInfo
    result: ExecResult | None   # once output() reached the end

    def __init__(self, sandbox: Sandbox, info: ExecInfo):
        self._sb = sandbox
        self.info = info
        self.result = None

    @property
    def exec_id(self) -> str:
        return self.info.exec_id

    def __repr__(self) -> str:
        return f"Pty({self._sb.id!r}, exec_id={self.exec_id!r})"

    async def send(self, data: bytes | str) -> None:
        """Type `data` into the terminal (b"\\x03" is ^C, b"\\x04" ^D)."""
        await self._sb.send_stdin(self.exec_id, data)

    async def resize(self, cols: int, rows: int) -> None:
        await self._sb.resize(self.exec_id, cols, rows)

    async def signal(self, signal: int = 15) -> None:
        """Send `signal` to the terminal's command (its process group)."""
        await self._sb.signal(self.exec_id, signal)

    async def kill(self) -> None:
        await self._sb.signal(self.exec_id, 9)

    async def output(self) -> AsyncIterator[bytes]:
        """The terminal's output as it comes (its recent output first), until the command ends
        (then .result is set)."""
        async for ev in self._sb.follow(self.exec_id):
            if ev.type == "pty":
                yield base64.b64decode(ev.data)
            elif ev.type == "exit":
                self.result = ev.result
                return

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.output()

    async def wait(self) -> ExecResult:
        """The command's end: exit code or signal."""
        self.result = await self._sb.attach(self.exec_id)
        return self.result


class Files:
    """sb.files: read, write, list and remove files inside the sandbox, as the sandbox user or
    as `user` ('root', 'sandbox', 'UID[:GID]': its permissions, and the owner of what it creates;
    root only where the project's policy allows it)."""

    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox

    @property
    def _url(self) -> str:
        return f"/v1/sandboxes/{self._sb.id}/files"

    @staticmethod
    def _params(path: str, user: str | None, **more: Any) -> dict[str, Any]:
        return {"path": path, **more, **({"user": user} if user is not None else {})}

    async def read(self, path: str, *, user: str | None = None) -> bytes:
        return (await self._sb._c._request("GET", self._url, params=self._params(path, user))).content

    async def read_text(self, path: str, encoding: str = "utf-8", *, user: str | None = None) -> str:
        return (await self.read(path, user=user)).decode(encoding)

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644, mkdirs: bool = True,
                    user: str | None = None) -> None:
        body = data.encode() if isinstance(data, str) else data
        await self._sb._c._request("PUT", self._url, params=self._params(path, user, mode=mode, mkdirs=mkdirs),
                                   content=body, headers=OCTETS)

    async def list(self, path: str = ".", *, user: str | None = None) -> list[FileEntry]:
        resp = await self._sb._c._request("GET", f"{self._url}/list", params=self._params(path, user))
        return FileList.model_validate_json(resp.content).entries

    async def remove(self, path: str, *, user: str | None = None) -> None:
        await self._sb._c._request("DELETE", self._url, params=self._params(path, user))

    async def watch(self, path: str, *, recursive: bool = False, user: str | None = None) -> AsyncIterator[FsEvent]:
        """Changes below directory `path` as they happen (its whole tree with recursive=True):
        first `start` (the watch is in place: later changes are seen), then create, write,
        remove, rename, chmod with the name relative to `path` (`overflow`: events were lost,
        list again). Until you stop iterating; NotFound if the directory is removed."""
        c = self._sb._c
        await c._ensure_ready()
        params = self._params(path, user, recursive="true" if recursive else "false")
        async with c._http.stream("GET", f"{self._url}/watch", params=params, timeout=httpx.Timeout(30.0, read=None)) as resp:
            if resp.status_code >= 400:
                _raise_for(resp, await resp.aread())
            async for line in resp.aiter_lines():
                if line.startswith('{"error"'):
                    _raise_for(httpx.Response(500), line.encode())
                elif line:
                    yield FsEvent.model_validate_json(line)


def fncall_request(code: str, language: str = "python", *, files: dict[str, str | bytes] | None = None,
                   **kwargs: Any) -> FnCallRequest:
    """An FnCallRequest; `files` values may be text or bytes (sent as files / files_b64)."""
    text = {k: v for k, v in (files or {}).items() if isinstance(v, str)}
    binary = {k: base64.b64encode(v).decode() for k, v in (files or {}).items() if not isinstance(v, str)}
    fields = {k: v for k, v in kwargs.items() if v is not None}
    if binary:
        fields["files_b64"] = {**fields.get("files_b64", {}), **binary}
    return FnCallRequest(code=code, language=language, files=text, **fields)


def _fncall_failed(call: Any, error: str) -> FnCallResult:
    lang = call.language if isinstance(call, FnCallRequest) else (call.get("language", "") if isinstance(call, dict) else "")
    return FnCallResult(status=FnCallStatus.sandbox_error, language=str(lang), error=error)


def start_local_server(url: str = DEFAULT_URL) -> None:
    """Start `dsec up` in the background (embedded default), logging to <home>/server.log, serving
    at `url`'s host and port: where the caller then waits for it."""
    if not server_installed():
        # Fail now rather than wait AUTOSTART_WAIT_S for a server that cannot start.
        raise Unavailable("no dsec apiserver is running and the server side is not installed here",
                          fix=f"set DSEC_URL to a running dsec, or `{SERVER_INSTALL}` and `dsec up`")
    paths = Paths.from_env()
    paths.home.mkdir(parents=True, exist_ok=True)
    where = urlsplit(url)
    argv = [sys.executable, "-m", "dsec", "up", "--host", where.hostname or "127.0.0.1",
            "--port", str(where.port or DEFAULT_PORT)]
    with open(paths.server_log, "ab") as logf:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                         stderr=logf, start_new_session=True, env=os.environ.copy())
