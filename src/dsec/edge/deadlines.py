"""When the reaper must look at a sandbox next, in a heap: each tick costs O(due), not O(n).

A sandbox's next deadline is the earliest of its idle TTL, its idle parking and its absolute
lifetime. Activity does not touch the heap (a request must not pay for the reaper): an entry
that comes due is checked against the sandbox's current times and pushed again if it moved.
So a sandbox in use costs one heap operation per TTL period, an idle one exactly one.
"""

from __future__ import annotations

import heapq


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._next: dict[str, float] = {}     # id -> the deadline its live heap entry has

    def push(self, sandbox_id: str, when: float) -> None:
        """Look at the sandbox at `when` (an earlier entry still pending makes this a no-op:
        the reaper re-reads the sandbox's times when it comes due)."""
        pending = self._next.get(sandbox_id)
        if pending is not None and pending <= when:
            return
        self._next[sandbox_id] = when
        heapq.heappush(self._heap, (when, sandbox_id))

    def due(self, now: float) -> list[str]:
        """Pop every sandbox whose deadline has come."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            when, sid = heapq.heappop(self._heap)
            if self._next.get(sid) == when:       # else a stale entry (an earlier one replaced it)
                del self._next[sid]
                out.append(sid)
        return out

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: its entry is dropped when it comes due."""
        self._next.pop(sandbox_id, None)

    def __len__(self) -> int:
        return len(self._next)
