"""The web dashboard: static files under /ui (apiserver/ui/), no key needed to fetch them.

The pages hold no data: the browser asks the JSON API for it with the key the user typed,
kept in sessionStorage and sent as `Authorization: Bearer` (never in a URL, so never in a
log, a Referer or the history). Only the files listed here are served (no path from the
request reaches the filesystem), with a Content-Security-Policy that allows this origin's
scripts only: a sandbox label or error shown on a page cannot become a script (the pages
also write every value as text, never as HTML).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

from dsec.types import NotFound

UI_DIR = Path(__file__).parent / "ui"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
FILES = ("index.html", "style.css", "app.js", "api.js", "dom.js", "chart.js", "events.js", "pages.js")
UI_PATHS = frozenset({"/ui", "/ui/", *(f"/ui/{name}" for name in FILES)})   # public: the guard lets them by
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",       # revalidate: a new dsec version's pages show at once
}


def _file(name: str) -> Response:
    body = (UI_DIR / name).read_bytes()
    return Response(body, media_type=TYPES[Path(name).suffix], headers=HEADERS)


def add_ui_routes(app: FastAPI) -> None:
    @app.get("/ui", include_in_schema=False)
    async def ui_root() -> RedirectResponse:
        return RedirectResponse("/ui/", status_code=308)

    @app.get("/ui/", include_in_schema=False)
    async def ui_index() -> Response:
        return _file("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def ui_file(name: str) -> Response:
        if name not in FILES:
            raise NotFound(f"no dashboard file {name[:64]!r}", field="path", fix="open /ui/")
        return _file(name)
