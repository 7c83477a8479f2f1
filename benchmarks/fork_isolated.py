"""`dsec bench fork` against a server of its own (own DSEC_HOME and port, removed afterwards),
so a run never touches the node's own dsec or another session's.

    PYTHONPATH=src .venv/bin/python benchmarks/fork_isolated.py --n 8,32 --files 20000 --setup-s 20 \
        --note "the box was shared with other engineers' test runs"
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
from pathlib import Path

from dsec.bench.fork import run_fork_bench
from dsec.config import Paths
from dsec.images.builtin import ensure_builtin
from dsec.images.service import ImageService
from dsec.testing.isolated import ServerProcess, cleanup_home, link_node_downloads

# a neighbour's burst drives the shared box's PSI up: creates must not be refused for it here
NO_PSI = {f"DSEC_ADMIT_PSI_{k}": "100" for k in ("CPU_SOME", "MEMORY_SOME", "MEMORY_FULL", "IO_FULL")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="8,32")
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--setup-s", type=float, default=20.0)
    ap.add_argument("--replay-max", type=int, default=32)
    ap.add_argument("--note", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="dsec-forkbench-", dir="/var/tmp"))
    home.chmod(0o711)
    srv = None
    try:
        link_node_downloads(home)
        ensure_builtin(ImageService(Paths(home)), "debian-python")
        srv = ServerProcess(home, NO_PSI)
        srv.start()
        os.environ.update(DSEC_HOME=str(home), DSEC_URL=srv.url, DSEC_API_KEY=srv.key)
        run_fork_bench([int(x) for x in a.n.split(",") if x], a.files, a.setup_s, a.replay_max, a.out.resolve(),
                       a.note, a.rounds)
    finally:
        if srv is not None:
            srv.kill(signal.SIGTERM)
        cleanup_home(home)


if __name__ == "__main__":
    main()
