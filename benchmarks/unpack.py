"""Unpacking an image layer: the old way (GNU tar as root) beside D45's (bsdtar chrooted into
the target, with and without the Python filter for untrusted archives), on the same plain tar.

    .venv/bin/python benchmarks/unpack.py [TARBALL]   (default: the debootstrap cache in DSEC_HOME)

Each way runs 3 times into a fresh directory (page cache warm after a first untimed read);
prints the median seconds, MB/s and the ratio to GNU tar."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsec.config import Paths
from dsec.images.unpack import LAYER_RULES, unpack_beneath


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else next((Paths.from_env().home / "cache").glob("*.tar.zst"))
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        tar = Path(tmp) / "layer.tar"
        subprocess.run(["bsdtar", "-c", "-f", str(tar), f"@{src}"], check=True)   # to a plain tar
        size_mb = tar.stat().st_size / 1e6
        tar.read_bytes()                                                          # warm the page cache

        def gnu(dest: Path) -> None:
            subprocess.run(["tar", "-x", "-f", str(tar), "-C", str(dest), "--numeric-owner", "--same-owner",
                            "--same-permissions", "--xattrs", "--xattrs-include=*", "--acls"], check=True)

        def chrooted(dest: Path) -> None:
            unpack_beneath(tar, dest, field="bench", rules=None)

        def filtered(dest: Path) -> None:
            unpack_beneath(tar, dest, field="bench", rules=LAYER_RULES)

        rows = []
        for name, fn in (("GNU tar as root (before D45)", gnu), ("bsdtar --chroot (trusted)", chrooted),
                         ("filter + bsdtar --chroot (untrusted)", filtered)):
            times = []
            for i in range(3):
                dest = Path(tmp) / f"out-{i}"
                dest.mkdir()
                t0 = time.perf_counter()
                fn(dest)
                times.append(time.perf_counter() - t0)
                shutil.rmtree(dest)
            rows.append((name, statistics.median(times)))
        base = rows[0][1]
        print(f"{src.name}: {size_mb:.0f} MB plain tar")
        print("| way | median s | MB/s | x GNU tar |\n|---|---|---|---|")
        for name, t in rows:
            print(f"| {name} | {t:.2f} | {size_mb / t:.0f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
