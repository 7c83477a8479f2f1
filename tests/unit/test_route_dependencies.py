"""The dependencies of dsec's own API routes are coroutines (issue 29): FastAPI runs a plain
`def` dependency in its thread pool, and `who: Who, ctx: Ctx` on every route made that two
thread hand-offs per request (a third of the apiserver's CPU per `exec true`, measured with
benchmarks/request_cpu_ab.py) for what is a dict lookup on the loop."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

import dsec.apiserver.routes as routes_pkg
from dsec.apiserver import deps


def _sync_dependencies(d: Dependant, where: str) -> list[str]:
    out = []
    for sub in d.dependencies:
        call = sub.call
        if call is not None and not (inspect.iscoroutinefunction(call) or inspect.isasyncgenfunction(call)):
            out.append(f"{where}: {getattr(call, '__qualname__', call)}")
        out += _sync_dependencies(sub, where)
    return out


def _routers() -> list:
    mods = [importlib.import_module(f"{routes_pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(routes_pkg.__path__)]
    mods += [importlib.import_module(n) for n in ("dsec.apiserver.metrics_routes", "dsec.apiserver.rulesets")]
    return [m.router for m in mods if hasattr(m, "router")]


def test_shared_dependencies_are_coroutines():
    for alias in (deps.Who, deps.Ctx):
        dep = alias.__metadata__[0].dependency
        assert inspect.iscoroutinefunction(dep), f"{dep.__qualname__} runs in the thread pool on every request"


def test_no_route_of_the_api_has_a_thread_pool_dependency():
    routers = _routers()
    assert len(routers) >= 8
    found = []
    for r in routers:
        for route in r.routes:
            if isinstance(route, APIRoute):
                found += _sync_dependencies(route.dependant, f"{','.join(sorted(route.methods))} {route.path}")
    assert not found, "plain `def` dependencies (run in the thread pool per request): " + "; ".join(found[:10])
