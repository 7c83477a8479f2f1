"""A VM's serial console on the host: read from a pipe QEMU writes, kept in a file of bounded size.

QEMU used to append the guest's ttyS0 straight to `console.log` (a `file` chardev), so a guest
writing without pause (root with `iopl(3)` and `outb` to 0x3f8, or a printk storm) grew a host
file at ~1 MB/s without limit. Now the console chardev is a pipe (`-chardev pipe,path=D/console`:
QEMU writes the FIFO `console.out`, non-blocking, and reads `console.in`, which nobody writes)
and the edge reads it here:

- **Hard cap on disk**: `console.log` never exceeds `CONSOLE_MAX_BYTES` (default 1 MiB,
  `DSEC_VM_CONSOLE_MAX_BYTES`): when the next chunk would pass it, the file is rewritten to its
  newest half (atomically: readers see the old or the new file). Nothing else writes it.
- **Bounded edge cost**: after each read the tap waits `CONSOLE_PACE_S` before the next, so a
  busy console costs the edge at most ~20 wakeups/s (the pipe, 64 KiB, absorbs a burst in the
  meantime: ~1.3 MB/s, far more than a booting kernel writes); a token bucket (`CONSOLE_RATE`
  bytes/s after `CONSOLE_BURST`) stretches the wait for a guest that floods. While the pipe is
  full QEMU's 16550 holds, then drops, the guest's bytes; QEMU itself never blocks.
- **Bounded while the edge is away**: the pipe holds at most 64 KiB in the kernel, then QEMU
  drops; a restarted edge reopens the FIFO (`VMDriver.recover`) and gets what it holds.

Chosen over (a) a unix-socket chardev: QEMU writes the console one byte per send(), each an
skb of its own, so a socket buffers only ~300 bytes and a reader either wakes for every few
bytes (measured: ~1,000 wakeups/s, 1.2 s of edge CPU per 8 s of flood) or stalls the guest;
a pipe merges the bytes into pages; (b) QEMU's in-memory `ringbuf` chardev: bounded, but it
dies with QEMU, and a dead VM's end reason ("Kernel panic") is read from its console after
QEMU exited; (c) truncating the file QEMU appends to now and then: bounded only by rate x
period, not at all while the edge is down; (d) a helper process per VM.

`drain(d)` reads whatever is buffered at once (before the console is read for an error
message: QEMU may have written its last lines and exited a moment ago).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
import time
from pathlib import Path

log = logging.getLogger("dsec.backends.vm")

CONSOLE_MAX_BYTES = 1 << 20      # the default of DSEC_VM_CONSOLE_MAX_BYTES (at least 64 KiB)
CONSOLE_RATE = 64 << 10        # bytes/s read from a guest's console, sustained
CONSOLE_BURST = 256 << 10      # bytes read before the rate applies
CONSOLE_PACE_S = 0.05          # at least this long between two reads of one console
READ_CHUNK = 64 << 10

_taps: dict[Path, "ConsoleTap"] = {}    # VM dir -> its tap (one QEMU at a time per dir)


def chardev_base(d: Path) -> Path:
    """The `path=` of QEMU's pipe chardev for VM dir `d` (it opens `<path>.in`/`<path>.out`)."""
    return d / "console"


def make_fifos(d: Path) -> Path:
    """Create the console FIFOs in VM dir `d` (kept if present); returns the chardev path."""
    base = chardev_base(d)
    for suffix in (".in", ".out"):
        p = base.with_name(base.name + suffix)
        try:
            os.mkfifo(p, 0o600)
        except FileExistsError:
            if not stat.S_ISFIFO(p.lstat().st_mode):
                p.unlink()
                os.mkfifo(p, 0o600)
    return base


class ConsoleTap:
    """One VM's console: QEMU's FIFO -> `log_path`, at most `max_bytes` on disk."""

    def __init__(self, fifo: Path, log_path: Path, max_bytes: int = CONSOLE_MAX_BYTES):
        self.key = log_path.parent
        self.fifo = fifo
        self.log_path = log_path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._fd = -1
        self._size = 0
        self._tokens = float(CONSOLE_BURST)
        self._t = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._paused: asyncio.TimerHandle | None = None
        self.read_bytes = 0          # what was read in all
        self.wakeups = 0             # reads triggered by the pipe (the edge's cost of a console)

    # -- life ---------------------------------------------------------------------------------
    def open(self) -> bool:
        """Open QEMU's console FIFO and start reading it in the running loop. False if there is
        none (QEMU started with a file console by an older edge)."""
        try:
            fd = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            return False
        self._fd = fd      # the one fd a VM's console holds in the edge; the log is opened per write
        try:
            self._size = self.log_path.stat().st_size
        except FileNotFoundError:
            self._size = 0
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._readable)
        return True

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed() and self._fd >= 0 and not _in_loop(loop):
            loop.call_soon_threadsafe(self.close)    # the selector belongs to the loop's thread
            return
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        if self._fd >= 0:
            if loop is not None and not loop.is_closed():
                loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1

    @property
    def closed(self) -> bool:
        return self._fd < 0

    # -- reading -----------------------------------------------------------------------------
    def _readable(self) -> None:
        self.wakeups += 1
        now = time.monotonic()
        self._tokens = min(float(CONSOLE_BURST), self._tokens + (now - self._t) * CONSOLE_RATE)
        self._t = now
        n = self.drain(int(max(self._tokens, READ_CHUNK)))
        self._tokens -= n
        if self._fd < 0 or self._loop is None:
            return                       # EOF: QEMU is gone
        # pace: let the pipe gather more before the next read; longer for a guest over its rate
        self._loop.remove_reader(self._fd)
        delay = CONSOLE_PACE_S if self._tokens > 0 else min(1.0, max(CONSOLE_PACE_S, -self._tokens / CONSOLE_RATE))
        self._paused = self._loop.call_later(delay, self._resume)

    def _resume(self) -> None:
        self._paused = None
        if self._fd >= 0 and self._loop is not None:
            self._loop.add_reader(self._fd, self._readable)

    def drain(self, limit: int = 1 << 62) -> int:
        """Read what QEMU has written (up to `limit` bytes) into the file; at EOF (QEMU gone:
        no writer left) the tap closes itself. Returns the bytes read."""
        got, eof, chunks = 0, False, []
        with self._lock:
            while self._fd >= 0 and got < limit:
                try:
                    data = os.read(self._fd, min(READ_CHUNK, limit - got))
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    data = b""
                if not data:
                    self._close_locked()
                    eof = True
                    break
                got += len(data)
                chunks.append(data)
            if chunks:
                self._append(b"".join(chunks))
        self.read_bytes += got
        if eof and _taps.get(self.key) is self:
            del _taps[self.key]
        return got

    def _append(self, data: bytes) -> None:
        if self._size + len(data) <= self.max_bytes:
            with open(self.log_path, "ab") as f:
                f.write(data)
            self._size += len(data)
            return
        # over the cap: keep the newest half (old tail + data), swapped in atomically
        keep = self.max_bytes // 2
        tail = b""
        if len(data) < keep and self._size:
            with open(self.log_path, "rb") as r:
                r.seek(max(0, self._size - (keep - len(data))))
                tail = r.read(keep - len(data))
        new = (tail + data)[-keep:]
        tmp = self.log_path.with_name(f".{self.log_path.name}.tmp")
        with open(tmp, "wb") as w:
            w.write(new)
        os.replace(tmp, self.log_path)
        self._size = len(new)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def attach(d: Path, max_bytes: int = CONSOLE_MAX_BYTES) -> ConsoleTap | None:
    """Start reading the console of the QEMU now running in VM dir `d` (`console.out` ->
    `console.log`), replacing the tap of a previous QEMU there. Must run in the event loop,
    after QEMU has opened the FIFO (else the first read is an EOF). None if there is no FIFO."""
    detach(d)
    base = chardev_base(d)
    tap = ConsoleTap(base.with_name(base.name + ".out"), d / "console.log", max_bytes)
    tap.key = d
    if not tap.open():
        return None
    _taps[d] = tap
    return tap


def drain(d: Path) -> None:
    """Bring `d`'s console.log up to date with what QEMU has written so far."""
    tap = _taps.get(d)
    if tap is not None:
        tap.drain()


def detach(d: Path) -> None:
    """Read what is left, then stop reading `d`'s console."""
    tap = _taps.pop(d, None)
    if tap is not None:
        tap.drain()
        tap.close()


def tap_of(d: Path) -> ConsoleTap | None:
    return _taps.get(d)
