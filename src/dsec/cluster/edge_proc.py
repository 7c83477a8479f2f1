"""An edge in its own network namespace: the EdgeNode actor's child process (D40).

A netns is per thread: setns() in the Ray worker would move one thread, while the edge's
thread pool, its subprocesses and Ray's own threads stay behind. So the actor starts this
module as a process of its own, entered into the netns by `nsenter --net` (the host's mount
namespace is kept: the edge's mounts stay visible to the host and its cleanup):

    nsenter --net=/run/netns/dsec-<node> -- python -m dsec.cluster.edge_proc

It reads its settings as one JSON line on stdin (the path of the node's secret file among them),
serves, writes {"url": ...} as one JSON line on stdout, and then lives exactly as long as the
actor: PR_SET_PDEATHSIG kills it with the actor's process, and so does the end of stdin (the
actor holds the write end; robust even where the forking thread is not the actor's last).
SIGTERM stops it cleanly (sandboxes keep running, as with any edge stop).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
import threading
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: str | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if parent and os.getppid() != int(parent):      # the parent (argv[1]) died before the prctl
        os._exit(1)


def _watch_stdin() -> None:
    """EOF on stdin: the actor process is gone (or closed it): die as it would have."""
    while sys.stdin.buffer.read(4096):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


async def _run(cfg: dict[str, Any]) -> None:
    from dsec.cluster.actors import start_edge
    from dsec.settings import Settings
    settings = Settings.from_env().with_home(cfg["home"])     # this process's (the actor's environment)
    stack, url = await start_edge(settings, cfg["node_id"], cfg["secret_file"], cfg["system_project"],
                                  cfg["host"], cfg.get("builtin_images") or [], cfg.get("seed_bin"),
                                  int(cfg.get("port") or 0), cfg.get("tls_file"))
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    loop.add_signal_handler(signal.SIGINT, stopping.set)
    try:
        sys.stdout.write(json.dumps({"url": url, "pid": os.getpid()}) + "\n")
        sys.stdout.flush()
        os.dup2(2, 1)        # the ready line was the only stdout; logs go to stderr
        await stopping.wait()
    finally:
        await stack.aclose()


def main() -> None:
    _die_with_parent(sys.argv[1] if len(sys.argv) > 1 else None)
    cfg = json.loads(sys.stdin.buffer.readline())
    threading.Thread(target=_watch_stdin, name="edge-parent-watch", daemon=True).start()
    asyncio.run(_run(cfg))


if __name__ == "__main__":
    main()
