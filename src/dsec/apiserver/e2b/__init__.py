"""E2B drop-in: the E2B REST API and the in-sandbox envd API served by dsec, for the stock
e2b SDK (E2B_API_URL = E2B_SANDBOX_URL = http://HOST:PORT/e2b, E2B_API_KEY = a dsec key).

Everything is mounted at E2B_PREFIX as one ASGI application (dispatch.py). The envd side uses
connectrpc's server and the protobuf messages the e2b package ships: they come with the
`dsec-sandbox[e2b]` extra; without it the prefix answers 501 naming the extra.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dsec.apiserver.context import ApiContext
from dsec.apiserver.guard import E2B_PREFIX, e2b_error_body
from dsec.types import DsecError

log = logging.getLogger("dsec.apiserver.e2b")

INSTALL = "pip install 'dsec-sandbox[e2b]'"


def add_e2b_routes(app: FastAPI, ctx: ApiContext) -> None:
    """Mount the E2B API at E2B_PREFIX (or a 501 naming the extra when it is not installed)."""
    try:
        from dsec.apiserver.e2b.mount import build
    except ImportError as e:
        log.warning("E2B API not served: a package of the e2b extra is missing",
                    extra={"missing": e.name, "fix": INSTALL})
        app.mount(E2B_PREFIX, _missing_extra(str(e.name)))
        return
    from dsec.apiserver.e2b.hosts import UNSET_DOMAIN, E2BHostRouting
    domain = ctx.settings.server.ingress_domain
    app.mount(E2B_PREFIX, build(ctx, domain or UNSET_DOMAIN))
    # get_host(port) names: {port}-{sandboxID}.{domain}; with no domain, a clear 421 (hosts.py)
    app.add_middleware(E2BHostRouting, domain=domain)


def _missing_extra(name: str) -> Starlette:

    err = DsecError(f"the E2B API is not installed on this server (missing {name!r})", field="path",
                    fix=f"install it on the server: {INSTALL}")
    err.status = 501

    async def refuse(_: Request) -> Response:
        body = e2b_error_body(err)
        return JSONResponse(body, status_code=body["code"])

    return Starlette(routes=[Route("/{path:path}", refuse, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])])
