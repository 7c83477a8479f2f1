"""What IAM reads on every request (a key's principal, a project's ancestors, its effective
policy), cached with a bounded staleness.

An entry younger than `fresh_s` is served without asking the store: a key revoked on another
replica stops working within that (this process's own writes invalidate at once). An older one
is read again; if the store is unreachable (Unavailable), the old value is served while it is
younger than `stale_s`, so the sandboxes a caller already runs keep answering through a
control-store outage; past that, the outage is the caller's answer (503).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from dsec.types import Unavailable

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

MAX_ENTRIES = 100_000     # keys and projects of one deployment; past it the oldest half goes


class StaleCache(Generic[K, V]):
    """Thread-safe; misses and refreshes call `load` outside the lock (a slow store does not
    hold up hits on other entries)."""

    def __init__(self, fresh_s: float, stale_s: float):
        self.fresh_s = fresh_s
        self.stale_s = max(stale_s, fresh_s)
        self._lock = threading.Lock()
        self._entries: dict[K, tuple[float, V]] = {}      # key -> (read at, monotonic; value)

    def get(self, key: K, load: Callable[[], V]) -> V:
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and now - hit[0] < self.fresh_s:
            return hit[1]
        try:
            value = load()
        except Unavailable:
            if hit is not None and now - hit[0] < self.stale_s:
                return hit[1]           # the store is down: what it said last, while not too old
            raise
        except Exception:
            self.drop(key)              # e.g. the key was revoked or the project removed
            raise
        with self._lock:
            if len(self._entries) >= MAX_ENTRIES:
                for k in sorted(self._entries, key=lambda k: self._entries[k][0])[:MAX_ENTRIES // 2]:
                    del self._entries[k]
            self._entries[key] = (time.monotonic(), value)
        return value

    def drop(self, key: K) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
