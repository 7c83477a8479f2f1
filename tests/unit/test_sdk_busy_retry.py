"""The SDK waits out a refusal that passes (503/429 with Retry-After) on calls it may repeat:
GET/DELETE, and POSTs it keys for idempotency; bounded in count and in time, and off with
busy_retry_s=0 / DSEC_BUSY_RETRY_S=0. Against a real HTTP server (a thread on loopback) that
answers from a script."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsec.sdk import client as sdk
from dsec.sdk.client import Client
from dsec.types import CapacityExceeded, InvalidArgument, Unavailable


class Script:
    """What the server answers: per path, a list of (status, Retry-After or None) to give
    before it answers 200; and every request it saw (method, path, body)."""

    def __init__(self) -> None:
        self.plan: dict[str, list[tuple[int, str | None]]] = {}
        self.seen: list[tuple[str, str, bytes]] = []
        self.lock = threading.Lock()


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            path = self.path.split("?")[0]
            if path == "/healthz":
                return self._send(200, {"ok": True}, None)
            with script.lock:
                script.seen.append((self.command, path, body))
                plan = script.plan.get(path, [])
                status, retry = plan.pop(0) if plan else (200, None)
            if status == 200:
                return self._send(200, {"sandboxes": []}, None)
            code = "unavailable" if status == 503 else "capacity_exceeded"
            self._send(status, {"error": {"code": code, "message": f"busy ({status})", "field": "x"}}, retry)

        def _send(self, status: int, body: dict, retry: str | None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            if retry is not None:
                self.send_header("retry-after", retry)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _answer

    return H


@pytest.fixture
def scripted() -> Iterator[tuple[str, Script]]:
    script = Script()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", script
    finally:
        httpd.shutdown()
        httpd.server_close()


async def test_get_waits_the_servers_delay_then_succeeds(scripted):
    url, script = scripted
    script.plan["/v1/sandboxes"] = [(503, "1"), (429, "0")]
    async with Client(url, "k") as c:
        t0 = time.monotonic()
        assert await c.list() == []
        took = time.monotonic() - t0
    assert [m for m, p, _ in script.seen] == ["GET"] * 3
    assert took >= 0.9, took                 # the server's Retry-After was honoured


async def test_turned_off_the_first_refusal_is_raised(scripted, monkeypatch):
    url, script = scripted
    script.plan["/v1/sandboxes"] = [(503, "0")]
    async with Client(url, "k", busy_retry_s=0) as c:
        with pytest.raises(Unavailable) as e:
            await c.list()
    assert e.value.retry_after_s == 0 and len(script.seen) == 1
    script.seen.clear()
    script.plan["/v1/sandboxes"] = [(503, "0")]
    monkeypatch.setenv("DSEC_BUSY_RETRY_S", "0")
    async with Client(url, "k") as c:
        with pytest.raises(Unavailable):
            await c.list()
    assert len(script.seen) == 1


async def test_keyed_create_is_resent_with_its_key_a_bounded_number_of_times(scripted):
    url, script = scripted
    script.plan["/v1/sandboxes"] = [(429, "0")] * 100
    async with Client(url, "k") as c:
        with pytest.raises(CapacityExceeded):
            await c.create_container(image="busybox")
    posts = [json.loads(b) for m, _, b in script.seen if m == "POST"]
    assert len(posts) == sdk.BUSY_RETRIES + 1
    assert len({p["idempotency_key"] for p in posts}) == 1     # one create, asked again


async def test_unkeyed_post_and_refusals_without_delay_are_not_repeated(scripted):
    url, script = scripted
    script.plan["/v1/projects"] = [(503, "0")]
    script.plan["/v1/sandboxes"] = [(503, None)]
    async with Client(url, "k") as c:
        with pytest.raises(Unavailable):
            await c.create_project("p")            # no idempotency key: it might have been done
        with pytest.raises(Unavailable):
            await c.list()                         # no Retry-After: not a refusal that passes
    assert [(m, p) for m, p, _ in script.seen] == [("POST", "/v1/projects"), ("GET", "/v1/sandboxes")]


async def test_a_delay_beyond_the_budget_is_raised_at_once(scripted):
    url, script = scripted
    script.plan["/v1/sandboxes"] = [(503, "60")]
    async with Client(url, "k", busy_retry_s=5) as c:
        t0 = time.monotonic()
        with pytest.raises(Unavailable) as e:
            await c.list()
        assert time.monotonic() - t0 < 5 and e.value.retry_after_s == 60


def test_a_bad_setting_names_itself(monkeypatch):
    monkeypatch.setenv("DSEC_BUSY_RETRY_S", "soon")
    with pytest.raises(InvalidArgument) as e:
        Client("http://127.0.0.1:1", "k")
    assert e.value.field == "DSEC_BUSY_RETRY_S"
    monkeypatch.delenv("DSEC_BUSY_RETRY_S")
    with pytest.raises(InvalidArgument) as e:
        Client("http://127.0.0.1:1", "k", busy_retry_s=-1)
    assert e.value.field == "busy_retry_s"
