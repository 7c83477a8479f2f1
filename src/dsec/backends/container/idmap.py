"""Host uid/gid ranges for per-sandbox user namespaces.

Every container sandbox gets its own user namespace mapping in-sandbox ids 0..RANGE-1 to a
host range BASE..BASE+RANGE-1 that no other live sandbox on this host uses. So root inside is
an unprivileged host uid, and limits the kernel keeps per user (inotify instances, RLIMIT_NPROC,
pipe buffers, mqueue bytes) are per sandbox, not shared with neighbours or the host.

Why a host-wide registry (one file per claimed slot under /run/dsec/idranges) and not the
edge's database: several dsec homes may live on one host (test sessions, a dev server next to
CI), and two of them must never hand out the same range. /run is a tmpfs, so claims vanish on
reboot, exactly when every sandbox is gone too; an edge restart keeps them. A claim names the
sandbox directory that owns it: a claim whose directory no longer exists is stale (its owner
crashed before releasing it) and may be taken again, which makes leaks self-healing. Stale
claims are swept when a registry is opened (an edge starts) and taken back when every slot is
claimed; a claim is written whole (temporary file, rename), and one that is empty or unreadable
anyway counts as stale. The claim is made before the sandbox's config.json exists (which is
where `id_base` is read back from), so the driver also releases by owner (`release_owner`).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from dsec.types import CapacityExceeded

RANGE = 65536                                   # ids per sandbox: 0..65535 inside (nobody = 65534)
# the defaults of DSEC_IDMAP_FIRST, DSEC_IDMAP_SLOTS, DSEC_IDMAP_REGISTRY (dsec.settings)
FIRST = 1 << 28                                 # far above real host users
SLOTS = 4096                                    # 2^28 .. 2^29-1 by default
REGISTRY = Path("/run/dsec/idranges")


class IdRanges:
    """Allocate, look up and release per-sandbox host id ranges (see module doc)."""

    def __init__(self, registry: Path = REGISTRY, first: int = FIRST, slots: int = SLOTS):
        self.registry = registry
        self.first, self.slots = first, slots
        registry.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._hint = 0
        self.sweep()

    @contextmanager
    def _locked(self):
        fd = os.open(self.registry / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _claim_file(self, slot: int) -> Path:
        return self.registry / str(slot)

    def base(self, slot: int) -> int:
        return self.first + slot * RANGE

    def allocate(self, owner: Path) -> int:
        """Claim a free range for the sandbox directory `owner` (which must exist); its host base."""
        owner_s = str(owner.resolve())
        with self._locked():
            # probe from the hint on, one stat a slot: round robin means the next slot is
            # usually free, so a claim costs O(1) however many sandboxes the host holds (a
            # listing of the registry was ~3.6 ms at 3,700 claims, under the host-wide lock)
            slot = self._first_free()
            if slot is None:   # all claimed: take back claims whose sandbox directory is gone
                order = list(range(self._hint, self.slots)) + list(range(self._hint))
                slot = next((s for s in order if not self._owner_alive(s)), None)
            if slot is None:
                raise CapacityExceeded(f"no free uid range for a new sandbox ({self.slots} in use on this host)",
                                       fix="stop sandboxes, or raise DSEC_IDMAP_SLOTS")
            tmp = self.registry / f".{slot}.tmp"   # whole or not at all: a crash leaves no empty claim
            tmp.write_text(owner_s)
            tmp.replace(self._claim_file(slot))
            self._hint = (slot + 1) % self.slots   # round robin: a just-freed range rests a while
            return self.base(slot)

    def _first_free(self) -> int | None:
        """The first unclaimed slot at or after the hint, wrapping (called with the lock held)."""
        for i in range(self.slots):
            slot = (self._hint + i) % self.slots
            if not os.path.lexists(self._claim_file(slot)):
                return slot
        return None

    def _owner_alive(self, slot: int) -> bool:
        """Whether a claim's owner directory exists (called with the lock held, so no claim is
        half-written: an empty or garbled one is a crashed writer's, stale)."""
        try:
            owner = self._claim_file(slot).read_text()
        except OSError:
            return False
        return owner.startswith("/") and Path(owner).is_dir()

    def sweep(self) -> list[int]:
        """Free every stale claim (its owner directory is gone); returns the slots freed."""
        freed = []
        with self._locked():
            for name in os.listdir(self.registry):
                if name.isdigit() and not self._owner_alive(int(name)):
                    self._claim_file(int(name)).unlink(missing_ok=True)
                    freed.append(int(name))
                elif name.endswith(".tmp"):        # a claim being written when its writer died
                    (self.registry / name).unlink(missing_ok=True)
        return freed

    def release_owner(self, owner: Path) -> None:
        """Free whatever range `owner` claims (a sandbox torn down before its config.json,
        which records its base, was written: a crash or error during create)."""
        owner_s = str(owner.resolve())
        with self._locked():
            for name in os.listdir(self.registry):
                if not name.isdigit():
                    continue
                try:
                    if self._claim_file(int(name)).read_text() == owner_s:
                        self._claim_file(int(name)).unlink()
                except OSError:
                    pass

    def release(self, base: int, owner: Path) -> None:
        """Free the range at `base` if `owner` holds it (only after its processes are gone)."""
        slot = (base - self.first) // RANGE
        if not 0 <= slot < self.slots:
            return
        with self._locked():
            try:
                if self._claim_file(slot).read_text() == str(owner.resolve()):
                    self._claim_file(slot).unlink()
            except OSError:
                pass


def host_to_sandbox(host_id: int, base: int) -> int:
    """A host uid/gid seen in a sandbox's writable layer -> the id inside the sandbox.
    Ids outside the range are the overlay's own (whiteouts, made with host root creds: 0)
    or foreign: 0 stays 0, anything else becomes nobody."""
    if base <= host_id < base + RANGE:
        return host_id - base
    return 0 if host_id == 0 else 65534
