"""Kernel memory a sandbox makes the host hold outside its own pages.

- Loopback TCP buffers: on cgroup v1 socket memory is charged only to the host's global
  tcp_mem (one 128 MiB sandbox held 402 MB). Now each sandbox's cgroup has a kmem.tcp limit
  (spec.tcp_mem_bytes: a quarter of its memory, >= 16 MiB), which also turns on per-cgroup
  socket accounting; on cgroup v2 the kernel charges socket buffers to memory.max.
- Open files: every struct file is charged to the opener's memory cgroup, so a sandbox's files
  are bounded by its memory (RLIMIT_NOFILE x pids is not a bound: a file mmap'd and closed
  holds its struct file without an fd). What one sandbox could take from everybody was the
  node's fs.file-max, a count sized for one file per ~10 KiB of RAM (one 256 MiB sandbox held
  600k files, 24% of it). The node's file-max is now sized so that all the memory the node has,
  spent on files, does not reach it (spec.node_file_max).

Each attack runs in a fresh sandbox and is measured from the host: /proc/net/sockstat
("TCP: ... mem", pages, host-wide) and /proc/sys/fs/file-nr (allocated files, host-wide),
sampled while it runs; other activity on the host adds a little noise (slack below).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from dsec.backends.container import cgroups
from dsec.backends.container.spec import SOCKET_SYSCTLS, tcp_mem_bytes

from containment._util import cgroup_file

PAGE = os.sysconf("SC_PAGE_SIZE")
CONNS = 200
# A socket over its cgroup's limit may still queue one segment (the kernel forces that charge,
# net/core/sock.c __sk_mem_raise_allocated: the sender then waits): ~66-71 KiB per connection
# on loopback (64 KiB GSO segments), measured with 200 and 1,500 connections.
FORCED_PER_CONN = 96 << 10
SLACK = 8 << 20        # other tests and services on the host open sockets too


def _tcp_mem_bytes() -> int:
    for line in Path("/proc/net/sockstat").read_text().splitlines():
        if line.startswith("TCP:"):
            f = line.split()
            return int(f[f.index("mem") + 1]) * PAGE
    return 0


def _files_allocated() -> int:
    return int(Path("/proc/sys/fs/file-nr").read_text().split()[0])


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no MemTotal in /proc/meminfo")


async def _peak(read, stop: asyncio.Event) -> int:
    best = read()
    while not stop.is_set():
        best = max(best, read())
        await asyncio.sleep(0.02)
    return max(best, read())


async def _measure(sb, script: str, read, timeout_s: float = 60):
    """Run `script` (python3) in the sandbox as the default user while sampling `read()` on the
    host; returns (result, baseline, peak)."""
    name = f"/tmp/attack-{os.urandom(4).hex()}.py"
    await sb.files.write(name, script, mode=0o644)
    base = read()
    stop = asyncio.Event()
    sampler = asyncio.create_task(_peak(read, stop))
    try:
        r = await sb.run(f"python3 {name}", timeout_s=timeout_s)
    finally:
        stop.set()
        peak = await sampler
    return r, base, peak


# N loopback connections; the clients send and nobody reads, until every send would block
# (or STOP bytes are queued: enough to show an unbounded sandbox without hurting the host);
# then the buffers are held for 2 s while the host samples.
TCP_FLOOD = r'''
import socket, time
N, STOP = {conns}, {stop}
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(N)
port = ls.getsockname()[1]
clients, servers = [], []
for _ in range(N):
    c = socket.create_connection(("127.0.0.1", port)); s, _ = ls.accept()
    c.setblocking(False); clients.append(c); servers.append(s)
chunk, sent, t0, idle = b"x" * 65536, 0, time.time(), 0
while sent < STOP and idle < 3 and time.time() - t0 < 20:
    round_sent = 0
    for c in clients:
        while sent < STOP:
            try:
                n = c.send(chunk)
            except OSError:          # EAGAIN: this connection's buffers are full
                break
            sent += n; round_sent += n
    idle = 0 if round_sent else idle + 1
    if not round_sent:
        time.sleep(0.1)              # queued data may still move from sender to receiver
print("sent", sent, flush=True)
time.sleep(2)
'''


async def test_loopback_tcp_buffers_stay_within_the_sandbox_bound(client):
    """200 loopback TCP connections of a 128 MiB sandbox, written to and never read: the socket
    memory the host holds for them (sockstat TCP mem) stays within the sandbox's bound (its
    kmem.tcp limit on cgroup v1, its memory limit on v2, plus the one segment per connection the
    kernel always lets through), the sends just block; the sandbox still works afterwards."""
    sb = await client.create_container(image="debian-python", memory_mb=128)
    try:
        limit = (128 << 20) if cgroups.is_unified() else tcp_mem_bytes(128)
        if not cgroups.is_unified():
            knob = cgroup_file(sb.id, "memory", "memory.kmem.tcp.limit_in_bytes")
            assert int(knob.read_text()) == limit, "the sandbox has no socket-memory limit"
        # per socket: the kernel's default buffer ceilings in the sandbox's netns, not the host's
        r = await sb.run("cat /proc/sys/net/ipv4/tcp_rmem /proc/sys/net/ipv4/tcp_wmem")
        assert r.stdout.split() == " ".join(SOCKET_SYSCTLS.values()).split(), r
        bound = limit + CONNS * FORCED_PER_CONN
        stop = 4 * limit
        script = TCP_FLOOD.replace("{stop}", str(stop)).replace("{conns}", str(CONNS))
        r, base, peak = await _measure(sb, script, _tcp_mem_bytes)
        sent = int(r.stdout.split()[-1]) if r.stdout.startswith("sent") else -1
        charged = "" if cgroups.is_unified() else \
            f", charged to its cgroup {int(cgroup_file(sb.id, 'memory', 'memory.kmem.tcp.max_usage_in_bytes').read_text()) >> 20} MiB"
        print(f"\nqueued {sent >> 20} MiB in {CONNS} loopback connections; host TCP memory "
              f"+{(peak - base) >> 20} MiB (limit {limit >> 20} MiB, bound {bound >> 20} MiB){charged}")
        assert r.exit_code == 0 and sent > 0, r
        assert peak - base <= bound + SLACK, \
            f"host TCP memory grew {(peak - base) >> 20} MiB for one sandbox (bound {bound >> 20} MiB)"
        assert sent < stop, "every send succeeded: socket buffers are not bounded"
        assert (await sb.run("echo alive")).stdout == "alive\n"
    finally:
        await sb.stop()


# K processes each open /dev/null until the kernel refuses (EMFILE at nofile, ENOMEM or an
# OOM kill at the memory limit), hold the files for 2 s, report. The parent may itself be
# OOM-killed: the host's own sampling is what counts.
FILE_HOARD = r'''
import errno, os, select, time
K = 24
r, w = os.pipe()
kids = []
for _ in range(K):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        n, err = 0, "none"
        try:
            while True:
                os.open("/dev/null", os.O_RDONLY); n += 1
        except OSError as e:
            err = errno.errorcode.get(e.errno, str(e.errno))
        os.write(w, f"{n} {err}\n".encode())
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
os.close(w)
reports, dead, buf, t0 = [], set(), b"", time.time()
while len(reports) + len(dead) < K and time.time() - t0 < 30:
    if select.select([r], [], [], 0.1)[0]:
        buf += os.read(r, 65536)
        *lines, buf = buf.split(b"\n")
        reports += [line.decode().split() for line in lines if line]
    for k in kids:
        if k not in dead and os.waitpid(k, os.WNOHANG)[0]:
            dead.add(k)
time.sleep(2)
print("opened", sum(int(n) for n, _ in reports), "errors", sorted({e for _, e in reports}), "killed", len(dead), flush=True)
for k in kids:
    try:
        os.kill(k, 9)
    except OSError:
        pass
'''


async def test_open_files_cost_the_sandbox_memory_not_the_node_file_table(client):
    """24 processes of a 128 MiB sandbox (nofile 65536 each) open files until refused: what
    they hold is bounded by the sandbox's memory, and that many files times the number of such
    sandboxes the node's memory admits stays under the node's file table (fs.file-max), so no
    sandbox can leave the others with ENFILE."""
    mem_mb = 128
    sb = await client.create_container(image="debian-python", memory_mb=mem_mb, nofile=65536, pids_limit=64)
    try:
        r, base, peak = await _measure(sb, FILE_HOARD, _files_allocated)
        held = peak - base
        file_max = int(Path("/proc/sys/fs/file-max").read_text())
        admitted = _mem_total() // (mem_mb << 20)        # sandboxes of this size the node's memory holds
        print(f"\n{r.stdout.strip()!r}; host files +{held} (file-max {file_max}, "
              f"{100 * held / file_max:.2f}% of it; x{admitted} sandboxes = {held * admitted})")
        assert held > 10_000, f"the attack did not open files: {r}"
        assert held * 128 <= mem_mb << 20, f"{held} files held by a {mem_mb} MiB sandbox: not charged to it"
        assert held * admitted < file_max, \
            f"one {mem_mb} MiB sandbox held {held} files, {100 * held / file_max:.1f}% of fs.file-max {file_max}"
        if not cgroups.is_unified():
            usage = cgroup_file(sb.id, "memory", "memory.max_usage_in_bytes")
            assert int(usage.read_text()) <= mem_mb << 20
        assert (await sb.run("echo alive", timeout_s=30)).stdout == "alive\n"
    finally:
        await sb.stop()
