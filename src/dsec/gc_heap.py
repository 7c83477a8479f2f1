"""The server's startup heap out of the cyclic collector's reach.

A server process holds ~100k+ long-lived objects once started (modules, the FastAPI app and
its pydantic models, the edge's tables). Each full (gen-2) collection walks all of them: ~40-80
ms on this 2-core box, a stall every few hundred requests that was every request path's p99
(docs/benchmarks.md, "exec path's observability cost"). `gc.freeze()` after startup moves them
to a permanent generation that collections skip; what requests allocate is collected as before.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what startup left as garbage, then freeze the rest; how many objects froze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
