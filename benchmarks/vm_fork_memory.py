"""Host memory per microVM fork (issue 27 item 1): a 256 MiB busybox microvm fills N MiB of its
RAM (/dev/shm, non-zero bytes), forks `--n` times, and each fork's QEMU is measured: its PSS, and
the PSS and private (copied) part of its guest-RAM mapping. Run once per code version on a
server of its own (own DSEC_HOME and port, removed afterwards):

    PYTHONPATH=src .venv/bin/python benchmarks/vm_fork_memory.py --n 4 --fill-mb 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from dsec.config import Paths
from dsec.images.builtin import ensure_builtin
from dsec.images.service import ImageService
from dsec.sdk.client import Client
from dsec.testing.isolated import ServerProcess, cleanup_home, link_node_downloads

NO_PSI = {f"DSEC_ADMIT_PSI_{k}": "100" for k in ("CPU_SOME", "MEMORY_SOME", "MEMORY_FULL", "IO_FULL")}


def ram_mapping(pid: int, memory_mb: int) -> dict[str, int]:
    """kB of Rss/Pss/Private of the guest RAM mapping (the snapshot's RAM file, else the one
    anonymous mapping of exactly the guest's size), and the process's whole Pss."""
    size_kb = memory_mb * 1024
    out = {"ram_pss_kb": 0, "ram_private_kb": 0, "ram_rss_kb": 0}
    cur = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            name = head[5] if len(head) > 5 else ""
            cur = name.endswith("snap.ram") or (name == "" and (hi - lo) // 1024 == size_kb)
            continue
        if cur and head[0] in ("Pss:", "Rss:"):
            out[f"ram_{head[0][:-1].lower()}_kb"] += int(head[1])
        if cur and head[0] in ("Private_Clean:", "Private_Dirty:"):
            out["ram_private_kb"] += int(head[1])
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            out["pss_kb"] = int(line.split()[1])
    return out


async def bench(url: str, key: str, home: Path, n: int, fill_mb: int) -> dict:
    async with Client(url, api_key=key) as c:
        src = await c.create_microvm(image="busybox", memory_mb=256)
        try:
            r = await src.run(f"yes dsec-fork-bench-fill | head -c {fill_mb << 20} > /dev/shm/blob && echo ok", timeout_s=900)
            assert r.stdout.strip() == "ok", r
            t0 = time.monotonic()
            forked = await src.fork(n)
            fork_s = time.monotonic() - t0
            assert all(f.ok for f in forked.forks), [f.error for f in forked.forks]
            try:
                for k in forked.sandboxes:         # each fork reads the blob (maps its pages)
                    r = await k.run("cat /dev/shm/blob > /dev/null", timeout_s=900)
                rows = []
                for k in forked.sandboxes:
                    pid = int((Paths(home).vm_sandboxes / k.id / "qemu.pid").read_text())
                    rows.append(ram_mapping(pid, 256))
            finally:
                for k in forked.sandboxes:
                    await k.stop()
        finally:
            await src.stop()
    mib = lambda kb: round(kb / 1024, 1)   # noqa: E731
    return {"n": n, "fill_mb": fill_mb, "fork_s": round(fork_s, 2),
            "qemu_pss_mib": [mib(r["pss_kb"]) for r in rows],
            "ram_pss_mib": [mib(r["ram_pss_kb"]) for r in rows],
            "ram_private_mib": [mib(r["ram_private_kb"]) for r in rows],
            "ram_rss_mib": [mib(r["ram_rss_kb"]) for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--fill-mb", type=int, default=64)
    ap.add_argument("--home-dir", default="/var/tmp", help="where the server's DSEC_HOME is made (its filesystem "
                                                            "holds the snapshot and its RAM file)")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="dsec-vmforkmem-", dir=a.home_dir))
    home.chmod(0o711)
    srv = None
    try:
        link_node_downloads(home)
        ensure_builtin(ImageService(Paths(home)), "busybox")
        srv = ServerProcess(home, NO_PSI)
        srv.start()
        out = asyncio.run(bench(srv.url, srv.key, home, a.n, a.fill_mb))
        # the snapshot's RAM split (snapram.py), where this code version has one
        splits = [json.loads(line) for line in (home / "server.log").read_text().splitlines()
                  if '"vm snapshot ram split"' in line]
        out["split_s"] = [r.get("seconds") for r in splits]
        out["split_phases_s"] = [{k: r.get(k) for k in ("launch_s", "load_s", "save_s")}
                                 for r in splits]
        out["parent_paused_s"] = [json.loads(line).get("paused_s") for line in
                                  (home / "server.log").read_text().splitlines() if '"vm snapshot pause"' in line]
        out["load_1m"] = os.getloadavg()[0]
        print(json.dumps(out))
    finally:
        if srv is not None:
            srv.kill(signal.SIGTERM)
        cleanup_home(home)
    os.sync()


if __name__ == "__main__":
    main()
