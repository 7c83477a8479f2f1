"""crun's compiled seccomp filter, kept after the first start and handed back to it (D103).

crun 1.8 compiles the OCI `linux.seccomp` section with libseccomp at every start: ~2 ms of CPU a
create for dsec's profile (bench/floor.py's `no-seccomp` replay), the same work each time since the
profile is the node's. crun writes what it compiled to its state directory (`seccomp.bpf`, the
filter `crun exec` loads again), and takes raw filter data through the annotation
`run.oci.seccomp_bpf_data` (base64; then the seccomp section is not compiled). So the driver reads
the filter crun made for the first sandbox of a profile and gives it to every later start of the
same profile and the same crun binary: the very filter crun would have compiled, loaded by crun
the same way. The config keeps its seccomp section (what the filter is; the tests read it).

Keyed by the profile's JSON and the crun binary (device, inode, size, mtime): an upgraded crun, or
another profile, compiles afresh once. Kept in memory only: a restarted node compiles once again.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from pathlib import Path

ANNOTATION = "run.oci.seccomp_bpf_data"
STATE_FILE = "seccomp.bpf"
MAX_BYTES = 8 * 4096          # BPF_MAXINSNS instructions of 8 bytes

log = logging.getLogger(__name__)


class CompiledFilters:
    def __init__(self, crun: str):
        try:
            st = os.stat(crun)
            self._crun_id = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            self._crun_id = crun
        self._data: dict[str, str] = {}     # key -> base64 filter

    @property
    def known(self) -> bool:
        """Whether any filter is kept (the node's profile is one: after that, no more reads)."""
        return bool(self._data)

    def _key(self, profile: dict) -> str:
        return hashlib.sha256((self._crun_id + json.dumps(profile, sort_keys=True)).encode()).hexdigest()

    def annotate(self, cfg: dict) -> bool:
        """Add the compiled filter of cfg's seccomp profile, if known; whether it did."""
        profile = cfg.get("linux", {}).get("seccomp")
        data = self._data.get(self._key(profile)) if profile else None
        if data is None:
            return False
        cfg.setdefault("annotations", {})[ANNOTATION] = data
        return True

    def learn(self, cfg: dict, state_dir: Path) -> None:
        """After crun started cfg without the annotation: keep the filter it compiled (its
        state directory's copy). A missing or implausible file is skipped: crun compiles again."""
        profile = cfg.get("linux", {}).get("seccomp")
        if not profile or ANNOTATION in cfg.get("annotations", {}):
            return
        key = self._key(profile)
        if key in self._data:
            return
        try:
            raw = (state_dir / STATE_FILE).read_bytes()
        except OSError:
            return
        if not raw or len(raw) % 8 or len(raw) > MAX_BYTES:
            log.warning("crun's compiled seccomp filter not kept: unexpected size",
                        extra={"bytes": len(raw), "path": str(state_dir / STATE_FILE)})
            return
        self._data[key] = base64.b64encode(raw).decode()
        log.info("crun's compiled seccomp filter kept for later starts", extra={"bytes": len(raw)})
