"""A real HTTP webhook receiver for tests: a thread in the test process on a fixed loopback
port, down until start() (a receiver that is away, then comes back, on the same URL)."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer


class Receiver:
    def __init__(self) -> None:
        with socket.socket() as s:     # a free port, then released: nothing listens until start()
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.got: list[tuple[dict[str, str], bytes]] = []   # (lower-cased headers, body) per POST
        self._srv: HTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> None:
        got = self.got

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a: object) -> None:
                pass
        self._srv = HTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._srv.serve_forever, daemon=True, name="webhook-receiver").start()

    def stop(self) -> None:
        if self._srv is not None:
            self._srv.shutdown()
            self._srv.server_close()
            self._srv = None
