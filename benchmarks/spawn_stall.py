"""`PYTHONPATH=src python benchmarks/spawn_stall.py ROUNDS N [HOGS]`: how long the event loop stands
still per child spawned, the way the driver spawns (subprocess.Popen on the loop: Python 3.11
vforks holding the GIL until the child has exec'd) vs glibc posix_spawn through ctypes from a
thread, without the GIL (tried for D97 and not kept: it cut the loop's stalls but cost the server
more CPU per create than it saved; the code is here, as it was tried). Each round spawns N `true` children, 4 at a time (the edge's start slots),
while HOGS busy processes (default 2: this box's cores) keep the CPUs contended as a burst does,
and a ticker on the loop measures its lag (sleep(1 ms) overshoot) and the process's CPU per spawn.
Alternating rounds; medians."""
import asyncio
import ctypes
import ctypes.util
import fcntl
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

POSIX_SPAWN_SETSIGDEF = 0x04
POSIX_SPAWN_SETSIGMASK = 0x08
_ACTIONS_SIZE = 256          # posix_spawn_file_actions_t is 80 bytes on x86_64/aarch64 glibc
_ATTR_SIZE = 1024            # posix_spawnattr_t 336
_SIGSET_SIZE = 128

# a few threads of its own: a spawn never queues behind the default executor's file work
_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsec-spawn")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc if hasattr(libc, "posix_spawn_file_actions_addclosefrom_np") else None   # glibc 2.34+
    except OSError:
        return None


_LIBC = _libc()


def posix_spawn_available() -> bool:
    return _LIBC is not None


def _spawn(argv: Sequence[str], stdout: int, stderr: int, pass_fds: Sequence[int]) -> int:
    """posix_spawnp of argv; its pid. Runs in a thread: ctypes releases the GIL for the call."""
    libc = _LIBC
    assert libc is not None
    actions = ctypes.create_string_buffer(_ACTIONS_SIZE)
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    sigs = ctypes.create_string_buffer(_SIGSET_SIZE)
    opened: list[int] = []

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(rc, f"{what}: {os.strerror(rc)}")
    try:
        check(libc.posix_spawn_file_actions_init(actions), "posix_spawn_file_actions_init")
        check(libc.posix_spawnattr_init(attr), "posix_spawnattr_init")
        try:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            opened.append(null)
            # sources above every target, so no dup2 below overwrites one still to be read
            low = 3 + len(pass_fds)

            def above(fd: int) -> int:
                fd = null if fd == subprocess.DEVNULL else fd
                d = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, low)
                opened.append(d)
                return d
            srcs = [(above(null), 0), (above(stdout), 1), (above(stderr), 2)]
            srcs += [(above(fd), 3 + i) for i, fd in enumerate(pass_fds)]
            for src, target in srcs:      # dup2 to another number: the copy is inherited
                check(libc.posix_spawn_file_actions_adddup2(actions, src, target), "adddup2")
            check(libc.posix_spawn_file_actions_addclosefrom_np(actions, low), "addclosefrom_np")
            libc.sigemptyset(sigs)
            check(libc.posix_spawnattr_setsigmask(attr, sigs), "setsigmask")
            for s in (signal.SIGPIPE, signal.SIGXFSZ):     # what Popen(restore_signals=True) resets
                libc.sigaddset(sigs, int(s))
            check(libc.posix_spawnattr_setsigdefault(attr, sigs), "setsigdefault")
            check(libc.posix_spawnattr_setflags(attr, ctypes.c_short(POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK)),
                  "setflags")
            args = (ctypes.c_char_p * (len(argv) + 1))(*[os.fsencode(a) for a in argv], None)
            env = [os.fsencode(f"{k}={v}") for k, v in os.environ.items()]
            envp = (ctypes.c_char_p * (len(env) + 1))(*env, None)
            pid = ctypes.c_int(0)
            rc = libc.posix_spawnp(ctypes.byref(pid), os.fsencode(argv[0]), actions, attr, args, envp)
            if rc != 0:
                raise OSError(rc, f"{os.strerror(rc)}: {argv[0]!r}", argv[0])
            return pid.value
        finally:
            libc.posix_spawn_file_actions_destroy(actions)
            libc.posix_spawnattr_destroy(attr)
    finally:
        for fd in opened:
            os.close(fd)


ROUNDS, N = int(sys.argv[1]), int(sys.argv[2])
HOGS = int(sys.argv[3]) if len(sys.argv) > 3 else 2


async def popen_on_loop(argv: list[str]) -> int:
    """The driver's spawn (backends/container/spawn.py): Popen on the loop, exit through a pidfd."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(proc.pid)
    done: asyncio.Future[int] = loop.create_future()

    def exited() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        done.set_result(proc.wait())
    loop.add_reader(pidfd, exited)
    return await done


async def posix_spawned(argv: list[str]) -> int:
    """The tried spawn: posix_spawn in a thread of its own pool, exit through a pidfd."""
    loop = asyncio.get_running_loop()
    pid = await loop.run_in_executor(_pool, _spawn, argv, subprocess.DEVNULL, subprocess.DEVNULL, ())
    pidfd = os.pidfd_open(pid)
    done: asyncio.Future[int] = loop.create_future()

    def exited() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        done.set_result(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    loop.add_reader(pidfd, exited)
    return await done


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def one_round(spawn) -> tuple[float, float, float, float]:
    lags: list[float] = []
    stop = False

    async def ticker() -> None:
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(max(0.0, time.perf_counter() - t - 0.001))
    tick = asyncio.create_task(ticker())
    sem = asyncio.Semaphore(4)

    async def child() -> None:
        async with sem:
            assert await spawn(["true"]) == 0
    c0, t0 = cpu(), time.perf_counter()
    await asyncio.gather(*(child() for _ in range(N)))
    wall, used = time.perf_counter() - t0, cpu() - c0
    stop = True
    await tick
    lags.sort()
    return (sum(lags) / N * 1000, lags[int(len(lags) * 0.99)] * 1000, used / N * 1000, wall)


async def main() -> None:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
    try:
        res: dict[str, list[tuple[float, float, float, float]]] = {"popen on the loop": [], "posix_spawn": []}
        fns = {"popen on the loop": popen_on_loop, "posix_spawn": posix_spawned}
        for r in range(ROUNDS + 1):
            for name in (list(res) if r % 2 == 0 else list(reversed(res))):
                out = await one_round(fns[name])
                if r:
                    res[name].append(out)
        for name, xs in res.items():
            med = [statistics.median(x[i] for x in xs) for i in range(4)]
            print(f"{name:>17}: loop lag {med[0]:.3f} ms per spawn (p99 tick lag {med[1]:.2f} ms), "
                  f"process CPU {med[2]:.3f} ms per spawn, wall {med[3]:.2f} s for {N}; "
                  f"{ROUNDS} rounds, {HOGS} CPU hogs, load1 {os.getloadavg()[0]:.1f}")
    finally:
        for h in hogs:
            h.kill()
            h.wait()


asyncio.run(main())
