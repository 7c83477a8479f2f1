"""Port ingress for containers: a TCP connection from the host into a sandbox's own loopback.

A sandbox lives in a private network namespace, usually with loopback only, so nothing on the
host can route to it. Instead a short-lived thread of the host process enters the sandbox's
network namespace (setns on /proc/<init pid>/ns/net), creates and connects a TCP socket to
127.0.0.1:<port> there, and goes back to its own namespace. A socket stays in the namespace it
was created in, so the host process then uses it like any other (asyncio streams).

Why a dedicated thread per connection: setns changes the calling thread only. If going back
fails, that thread must never run anything else (it would open host sockets inside the
sandbox); a thread of our own simply ends, the default executor's would be reused.

The socket belongs to the host process's cgroup, not the sandbox's, so the sandbox's cgroup-BPF
egress policy does not apply to it: by design, the host is the client (docs/security.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import threading
import weakref
from pathlib import Path

log = logging.getLogger("dsec.backends.container.ports")

CLONE_NEWNET = 0x40000000
CONNECT_TIMEOUT_S = 5.0      # to a listener on loopback: only a full backlog or a frozen sandbox waits
# Connect threads alive at once, node-wide: a burst of requests to a sandbox whose listener
# never accepts once started a thread each (300 requests, 335 threads); the rest now wait.
MAX_CONNECT_THREADS = 64
_slots: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()

_libc = ctypes.CDLL(None, use_errno=True)   # Python 3.11 has no os.setns
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.setns.restype = ctypes.c_int


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def open_netns(pid: int, cgroup: str) -> int:
    """An fd on the network namespace of `pid`, checked to be the process in cgroup `cgroup`
    (the sandbox's init): a pid file naming a dead sandbox's reused pid must never lead into
    another process's namespace (the host's, say). FileNotFoundError if it is not there."""
    try:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        raise FileNotFoundError(f"process {pid} is gone") from None
    try:
        # checked after the open: a process that is ours now was ours when the fd was opened
        # (the sandbox's init existed before its pid file was read; live pids are not reused)
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        lines = []
    if not any(line.endswith(":" + cgroup) for line in lines):
        os.close(fd)
        raise FileNotFoundError(f"process {pid} is not the init of cgroup {cgroup}")
    return fd


def _connect_inside(netns_fd: int, port: int, timeout_s: float) -> socket.socket:
    """Runs on its own thread: enter the namespace, connect, leave. The socket is created
    inside (a socket's namespace is fixed at creation)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    sock: socket.socket | None = None
    try:
        _setns(netns_fd)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        finally:
            try:
                _setns(own)
            except OSError:
                # this thread ends with the error and runs nothing else; the process goes on
                log.critical("could not return to the host network namespace after a port connection; "
                             "the thread ends", exc_info=True)
                if sock is not None:
                    sock.close()
                raise
    finally:
        os.close(own)
    try:
        # connect() from the host namespace is fine: the socket routes in its own namespace
        sock.settimeout(timeout_s)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        return sock
    except BaseException:
        sock.close()
        raise


async def connect_in_netns(pid: int, cgroup: str, port: int,
                           timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """A connected, non-blocking TCP socket to 127.0.0.1:`port` in the network namespace of
    `pid`, the init of cgroup `cgroup` (the caller closes it). FileNotFoundError when that
    process is gone, ConnectionRefusedError when nothing listens, TimeoutError when the
    connect does not complete within `timeout_s`."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[socket.socket] = loop.create_future()

    def deliver(sock: socket.socket | None, error: BaseException | None) -> None:
        if fut.cancelled():          # the caller gave up meanwhile: nobody owns the socket
            if sock is not None:
                sock.close()
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(sock)      # type: ignore[arg-type]

    def work() -> None:
        # the thread owns every fd it opens: a caller cancelled mid-way closes nothing under it
        sock: socket.socket | None = None
        error: BaseException | None = None
        try:
            netns = open_netns(pid, cgroup)
            try:
                sock = _connect_inside(netns, port, timeout_s)
            finally:
                os.close(netns)
        except BaseException as e:   # delivered to the awaiting coroutine
            error = e
        try:
            loop.call_soon_threadsafe(deliver, sock, error)
            loop.call_soon_threadsafe(slots.release)    # the slot is the thread's, not the caller's
        except RuntimeError:          # the loop closed meanwhile
            if sock is not None:
                sock.close()

    slots = _slots.setdefault(loop, asyncio.Semaphore(MAX_CONNECT_THREADS))
    await slots.acquire()
    try:
        threading.Thread(target=work, name=f"dsec-port-{port}", daemon=True).start()
    except BaseException:
        slots.release()
        raise
    return await fut
