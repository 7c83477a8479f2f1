"""The SDK parses each API path's URL once per client (issue 29: httpx parsed and merged a
relative path with the base URL on every request, a tenth of the client's CPU per `run`), and
what goes on the wire is what it was: the base URL's own path prefix, the query parameters."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from dsec.sdk.client import URL_CACHE_SIZE, Client


class _Recorder(BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.path)
        body = json.dumps({"snapshots": []}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_paths_are_parsed_once_and_reach_the_server_unchanged() -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        async def go() -> Client:
            c = Client(f"http://127.0.0.1:{srv.server_port}/prefix/", "dsk_x", autostart=False)
            c._ready = True
            for _ in range(3):
                await c._request("GET", "/v1/snapshots")
            await c._request("GET", "/v1/snapshots", params={"a": "b c"})
            await c.close()
            return c
        c = asyncio.run(go())
    finally:
        srv.shutdown()
    assert _Recorder.seen == ["/prefix/v1/snapshots"] * 3 + ["/prefix/v1/snapshots?a=b+c"]
    assert list(c._urls) == ["/v1/snapshots"]
    assert isinstance(c._urls["/v1/snapshots"], httpx.URL)


def test_the_url_cache_is_bounded() -> None:
    c = Client("http://127.0.0.1:9", "dsk_x", autostart=False)
    for i in range(URL_CACHE_SIZE + 5):
        c._url(f"/v1/sandboxes/sb-{i}/exec")
    assert len(c._urls) <= URL_CACHE_SIZE
    asyncio.run(c.close())
