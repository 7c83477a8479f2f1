"""Build the static in-sandbox agent binary from the C source shipped next to this file."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from dsec.insandbox import source

log = logging.getLogger("dsec.agent")

SOURCE = source("dsec-agent.c")   # the one translation unit; it includes its parts from agent/
PARTS = SOURCE.parent / "agent"
# Preferred first: musl gives a ~100 KiB binary with a tiny idle footprint.
COMPILERS: tuple[tuple[str, str], ...] = (("musl-gcc", "musl-tools"), ("gcc", "gcc"))
CFLAGS = ("-static", "-Os", "-s", "-Wall", "-Wextra")


def source_files() -> list[Path]:
    return [SOURCE, *sorted(p for p in PARTS.iterdir() if p.suffix in (".c", ".h"))]


def source_hash() -> str:
    """Of the whole source (every part): a change anywhere names a new binary."""
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def agent_binary(bin_dir: Path) -> Path:
    """Return bin_dir/dsec-agent-<sha256(source)[:12]>, compiling it first if needed.

    Safe when several processes build at once: each compiles into its own temporary file
    and renames it into place atomically (the results are identical).
    """
    bin_dir = Path(bin_dir)
    target = bin_dir / f"dsec-agent-{source_hash()}"
    if os.access(target, os.X_OK):
        return target
    bin_dir.mkdir(parents=True, exist_ok=True)

    failures: list[str] = []
    for compiler, package in COMPILERS:
        path = shutil.which(compiler)
        if path is None:
            failures.append(f"{compiler}: not installed (Debian package {package})")
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=bin_dir)
        os.close(fd)
        try:
            proc = subprocess.run(
                [path, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300
            )
            if proc.returncode != 0:
                failures.append(f"{compiler} failed:\n{proc.stderr.strip()}")
                continue
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
            log.info("built %s with %s", target, compiler)
            return target
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    raise RuntimeError(
        "cannot build the dsec agent: install the Debian package 'musl-tools' (preferred) "
        "or 'gcc' (with libc6-dev for static linking).\n" + "\n".join(failures)
    )
