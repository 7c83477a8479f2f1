"""Which images a node holds locally, as a compact summary for its status (D34).

The edge records the image of every sandbox it creates; the watcher carries the summary to
placement, which prefers a node that already has the image (its layers are on local disk and
in page cache: no pull, no cold start) as long as that does not unbalance load.

Keys are the first 16 hex digits of an image digest (64 bits: a false match among a few
thousand images is ~1e-13 likely, and would only cost one cold start). The summary is an LRU
of at most `cap` keys, so a status stays a few KiB on the wire however many images a node has
seen; the frozenset handed out is rebuilt only when membership changes, so status() stays O(1)
per call in the number of sandboxes (D25).
"""

from __future__ import annotations

from collections import OrderedDict

KEY_HEX = 16
SUMMARY_CAP = 256


def image_key(digest: str) -> str:
    """'sha256:abcd...' (or a bare hex digest) -> its short key."""
    return digest.partition(":")[2][:KEY_HEX] if ":" in digest else digest[:KEY_HEX]


class CacheSummary:
    """Bounded, most-recently-used set of image keys. Not thread-safe (the edge's event loop)."""

    def __init__(self, cap: int = SUMMARY_CAP):
        self.cap = cap
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._frozen: frozenset[str] | None = frozenset()

    def add(self, digest: str) -> bool:
        """Record a use of the image; True if the node held it already (a locality hit)."""
        key = image_key(digest)
        if key in self._lru:
            self._lru.move_to_end(key)   # recency only: the published set is unchanged
            return True
        self._lru[key] = None
        if len(self._lru) > self.cap:
            self._lru.popitem(last=False)
        self._frozen = None
        return False

    def discard(self, digest: str) -> None:
        """The image left the node (garbage-collected)."""
        if self._lru.pop(image_key(digest), 0) is None:
            self._frozen = None

    def __contains__(self, digest: str) -> bool:
        return image_key(digest) in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> frozenset[str]:
        """The published set (shared, immutable; rebuilt after a change)."""
        if self._frozen is None:
            self._frozen = frozenset(self._lru)
        return self._frozen
