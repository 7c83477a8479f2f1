"""How long one database call may wait for the control store.

Unset (background work: index sync, quota reconcile, migrations): the store's own retry window
(DSEC_DB_RETRY_S), so a PostgreSQL restart costs latency, not data. An API request sets a short
budget (DSEC_DB_REQUEST_WAIT_S, apiserver/guard.py) and, while the store is known to be down,
is refused at once: a request that needs the store answers 503 + Retry-After within a second
instead of holding the caller (and, for calls made on the event loop, every other request).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

REQUEST_WAIT: ContextVar[float | None] = ContextVar("dsec_store_request_wait", default=None)
STORE_RETRY_AFTER_S = 1     # the Retry-After of a refusal while the store is down: it is probed every 0.25 s


def request_wait() -> float | None:
    """The budget of the calling request (None: not a request, the store's retry window)."""
    return REQUEST_WAIT.get()


@contextmanager
def waiting_at_most(seconds: float | None) -> Iterator[None]:
    """Database calls made inside (threads started with a copy of this context included) wait
    at most `seconds` for the store; None: as long as the store's retry window."""
    token = REQUEST_WAIT.set(seconds)
    try:
        yield
    finally:
        REQUEST_WAIT.reset(token)
