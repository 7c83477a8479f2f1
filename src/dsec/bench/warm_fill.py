"""Waiting for a node's warm pool (edge/warm_pool.py, D28) to fill, for the benchmarks that
burst from one (`dsec bench density`, `dsec bench warmpool`, benchmarks/burst_ab.py).

Not in the SDK: "full" is a benchmark's wait (a node refills in the background and a product
caller just creates); the SDK has the admin route itself (Client.warm_pools, set_warm_pools).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from dsec.sdk.client import Client

POLL_S = 0.5


async def wait_full(c: Client, image: str, size: int, timeout_s: float, *, stop_on_error: bool = False,
                    on_error: Callable[[str], None] | None = None, auto: bool = False) -> tuple[float | None, str | None]:
    """Wait until the node's pool of `image` holds `size` idle sandboxes, none starting (`auto`:
    the node's automatic pool of the image, D99, rather than the operator's).

    Returns (the seconds waited, or None when `timeout_s` passed first or a start error stopped
    the wait; the last start error the pool reported). A pool that reports an error (e.g.
    admission refused a start: a full node) ends the wait with `stop_on_error`, else it is
    passed to `on_error` on every poll that shows it and the wait goes on."""
    t0 = time.perf_counter()
    error: str | None = None
    while time.perf_counter() - t0 < timeout_s:
        pools = await c.warm_pools()
        st = (pools.auto if auto else pools.pools).get(image)
        if st is not None and st.idle >= size and st.starting == 0:
            return time.perf_counter() - t0, error
        if st is not None and st.error:
            error = st.error
            if stop_on_error:
                return None, error
            if on_error is not None:
                on_error(error)
        await asyncio.sleep(POLL_S)
    return None, error
