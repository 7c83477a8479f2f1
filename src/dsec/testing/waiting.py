"""The tests' one way of waiting for something to happen: poll a probe until it answers.

Every test that waits for a state (a sandbox ended, a pool refilled, a port listening, a file
written inside a sandbox) calls wait_until with a probe, instead of its own deadline loop.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_until(probe: Callable[[], T | Awaitable[T]], *, timeout_s: float = 10.0, every_s: float = 0.1,
                     what: str | None = None) -> T:
    """Call `probe` (plain or async) until it returns something truthy, and return that. At the
    deadline: with `what`, AssertionError naming it and the last answer; without, the last
    (falsy) answer itself, for callers that assert on it and show it."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if inspect.isawaitable(got):
            got = await got
        if got or time.monotonic() >= deadline:
            break
        await asyncio.sleep(every_s)
    if not got and what is not None:
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {got!r})")
    return got  # type: ignore[return-value]


def wait_until_sync(probe: Callable[[], T], *, timeout_s: float = 10.0, every_s: float = 0.1,
                    what: str | None = None) -> T:
    """wait_until for code that is not async (the probe is plain)."""
    deadline = time.monotonic() + timeout_s
    while not (got := probe()) and time.monotonic() < deadline:
        time.sleep(every_s)
    if not got and what is not None:
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {got!r})")
    return got
