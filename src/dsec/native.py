"""Compile the project's small native helpers (static C) on first use.

Native code is used only where Python cannot meet a measured need (see docs/decisions.md):
the in-sandbox agent (must run in any image at <1 MiB RSS) and dsec-nsexec (overlay mounted
in a private mount namespace before crun runs). Binaries are cached by source hash.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("dsec.native")


def compile_static(source: Path, bin_dir: Path, name: str) -> Path:
    """Return a static binary built from `source`, compiling it once per source version."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    out = bin_dir / f"{name}-{digest}"
    if out.exists():
        return out
    bin_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for cc in ("musl-gcc", "gcc"):
        if not shutil.which(cc):
            errors.append(f"{cc}: not installed")
            continue
        fd, tmp = tempfile.mkstemp(dir=bin_dir, prefix=f".{name}-")
        os.close(fd)
        proc = subprocess.run([cc, "-static", "-Os", "-Wall", "-o", tmp, str(source)],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            os.chmod(tmp, 0o755)
            os.replace(tmp, out)  # atomic: concurrent builders race harmlessly
            log.info("compiled native helper", extra={"helper": name, "cc": cc, "path": str(out)})
            return out
        os.unlink(tmp)
        errors.append(f"{cc}: {proc.stderr.strip()[-500:]}")
    raise RuntimeError(f"cannot compile {source.name}; install Debian packages musl-tools and gcc "
                       f"(apt-get install musl-tools gcc). Details: {'; '.join(errors)}")
