"""What image uploads hold on the node's disk, per project (issue 22, item 4).

An upload (a build context, an OCI layout, a `docker save` tar) is streamed to DSEC_HOME/build,
unpacked there and worked on, and removed when its work is done. Each one is bounded alone (the
body limit, the unpack bound); this ledger bounds them together: the bytes a project's uploads
in flight hold (their bodies as they arrive, then what their unpack may write) are counted
against the project's disk policy (max_disk_mb) or, without one, a node default; and no upload
may take the node's disk below a reserve. Beyond either, the request is refused (429) naming
what to change, and its bytes are given back.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from dsec.types import CapacityExceeded

MiB = 1 << 20
PROJECT_UPLOAD_BYTES = 32 * 1024 * MiB     # a project without max_disk_mb in its policy
DISK_RESERVE_BYTES = 2 * 1024 * MiB    # never unpack or stream into the last of the node's disk


@dataclass(eq=False)
class UploadHold:
    """One upload's bytes in the ledger; released (all at once) when its work dir is gone."""

    ledger: "UploadLedger"
    project: str
    limit: int
    held: int = 0
    released: bool = False

    def add(self, n: int, what: str = "the request body") -> None:
        """Count n more bytes, or refuse (CapacityExceeded) if the project or the disk has no room."""
        self.ledger._add(self, n, what)

    def add_up_to(self, n: int, what: str) -> int:
        """Count at most n more bytes: as many as the project's room allows (refused only when
        none is left). Returns the bytes counted, the bound to hold what follows to."""
        return self.ledger._add(self, n, what, partial=True)

    def release(self) -> None:
        self.ledger._release(self)


@dataclass(eq=False)
class UploadLedger:
    """Bytes held by image uploads in flight, per project (thread-safe: unpacks run on the heavy
    lane's threads, bodies arrive on the event loop)."""

    disk: Path                                   # the filesystem uploads land on (DSEC_HOME/build)
    held: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, project: str, max_disk_mb: int | None) -> UploadHold:
        limit = (max_disk_mb << 20) if max_disk_mb else PROJECT_UPLOAD_BYTES
        return UploadHold(self, project, limit)

    def _add(self, h: UploadHold, n: int, what: str, partial: bool = False) -> int:
        with self._lock:
            if h.released:
                raise CapacityExceeded("the upload was already given back", field="body", fix="send it again")
            now = self.held.get(h.project, 0)
            if partial:
                n = max(0, min(n, h.limit - now))
            if now + n > h.limit or (partial and n == 0):
                raise CapacityExceeded(
                    f"{what} would take this project's image uploads in flight on this node past "
                    f"{h.limit / MiB:.0f} MiB ({now / MiB:.0f} MiB held now by its other uploads and builds)",
                    field="body", fix="wait for the project's other uploads and builds to finish, send a smaller "
                                      "body, or ask an admin for a larger max_disk_mb in the project's policy")
            free = shutil.disk_usage(self.disk).free
            if partial:
                n = max(0, min(n, free - DISK_RESERVE_BYTES))
            if n > free - DISK_RESERVE_BYTES or (partial and n == 0):
                raise CapacityExceeded(
                    f"{what} does not fit on this node's disk ({free / MiB:.0f} MiB free, "
                    f"{DISK_RESERVE_BYTES / MiB:.0f} MiB kept in reserve)", field="body",
                    fix="retry later, or ask the operator to free disk space on the node")
            self.held[h.project] = now + n
            h.held += n
            return n

    def _release(self, h: UploadHold) -> None:
        with self._lock:
            if h.released:
                return
            h.released = True
            left = self.held.get(h.project, 0) - h.held
            if left > 0:
                self.held[h.project] = left
            else:
                self.held.pop(h.project, None)

    def in_flight(self, project: str) -> int:
        with self._lock:
            return self.held.get(project, 0)
