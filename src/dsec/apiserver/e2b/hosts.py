"""Hostname routing for E2B's `get_host(port)`: `{port}-{sandboxID}.{domain}`.

The e2b SDK hands users `get_host(port)` to reach a server in the sandbox by hostname (HTTP or
WebSocket). When the operator sets DSEC_DOMAIN (and points `*.DOMAIN` at the apiserver),
create answers carry that domain, so the SDK builds such names, and this middleware turns a
request for one into the sandbox traffic the SDK sends by header: the path moves under the E2B
prefix and `E2b-Sandbox-Id`/`E2b-Sandbox-Port` are set from the name. Nothing else changes: the
dispatcher still demands the sandbox's access token (or its traffic token, or a key of its
project) before any byte reaches the sandbox. It runs outside the guard so that the guard sees
the rewritten request and applies its body limits to it.

With no domain set, create answers name UNSET_DOMAIN (RFC 6761's `.invalid`: it resolves
nowhere, so the SDK's envd calls and get_host URLs fail at once instead of going to e2b.app
with the sandbox's tokens), and a request that reaches the server under such a name anyway is
answered 421 naming DSEC_DOMAIN.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dsec.apiserver.guard import E2B_PREFIX, E2B_SANDBOX_HEADER
from dsec.apiserver.e2b.envd_common import PORT_HEADER

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]
DOMAIN_ENV = "DSEC_DOMAIN"
UNSET_DOMAIN = "dsec-domain-unset.invalid"
DOMAIN_RE = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def check_domain(domain: str) -> str:
    domain = domain.strip().lower().rstrip(".")
    if not DOMAIN_RE.match(domain):
        raise ValueError(f"{DOMAIN_ENV}={domain!r} is not a DNS name: set it to e.g. sandboxes.example.com")
    return domain


class E2BHostRouting:
    def __init__(self, app: ASGIApp, domain: str | None):
        self.app = app
        self.unset = domain is None
        self.host_re = re.compile(r"^(\d{1,5})-([a-z0-9][a-z0-9-]{0,127})\."
                                  + re.escape(UNSET_DOMAIN if domain is None else check_domain(domain)) + r"(:\d+)?$")

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v for k, v in scope.get("headers", ()) if k == b"host"), b"").decode("latin-1").lower()
            m = self.host_re.match(host)
            if m is not None and self.unset:
                await _unset(scope, receive, send)
                return
            if m is not None:
                raw = scope.get("raw_path") or scope["path"].encode()
                scope = dict(scope)
                scope["path"] = E2B_PREFIX + scope["path"]
                scope["raw_path"] = E2B_PREFIX.encode() + raw
                # the name decides where it goes: headers of the same names are replaced
                headers = [(k, v) for k, v in scope.get("headers", ())
                           if k not in (E2B_SANDBOX_HEADER.encode(), PORT_HEADER.encode())]
                headers += [(E2B_SANDBOX_HEADER.encode(), m.group(2).encode()), (PORT_HEADER.encode(), m.group(1).encode())]
                scope["headers"] = headers
        await self.app(scope, receive, send)


async def _unset(scope: Scope, receive: Any, send: Any) -> None:
    from dsec.apiserver.e2b.errors import e2b_response
    from dsec.types import DsecError
    err = DsecError(f"this dsec server has no domain for sandbox hosts ({UNSET_DOMAIN} is a placeholder)",
                    field=DOMAIN_ENV, fix=f"the operator sets {DOMAIN_ENV} and points *.<domain> at the server "
                                          "(docs/e2b.md, \"Ports on a domain\"); meanwhile reach ports at "
                                          "/v1/sandboxes/{id}/ports/{port}/ with an API key")
    err.status = 421
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": "DSEC_DOMAIN is not set"})
        return
    await e2b_response(err)(scope, receive, send)
