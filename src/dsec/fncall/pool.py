"""Warm pool containers for FnCall: one Worker per container, one Pool per (image, family).

A Worker is a container created through the host's (edge's) normal create path (owned by the system
project, so admission counts it) running the zygote (insandbox/fncall_zygote.py) as one long-lived agent exec
with stdin kept open: requests go in as JSON lines on its stdin, results come back as JSON
lines on its stdout. One call at a time per worker.

A Pool hands idle workers to callers (most recently used first, so a light load stays on few
warm containers), queues callers when all are busy, starts workers while callers wait (up to a
ceiling, a few starts at a time), keeps a floor warm while the pool is in use, retires workers
idle above the floor, and replaces a worker after max_calls calls, after a call it could not
clean up, or when its result channel nears the agent's per-exec output cap.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dsec.agent.client import Exit, Output
from dsec.insandbox import source
from dsec.settings import FnCallEnvSettings
from dsec.types import (FNCALL_DEFAULT_IMAGE, ContainerArgs, DsecError, InvalidArgument, SandboxFailed,
                        Unavailable)

if TYPE_CHECKING:
    from dsec.fncall.host import SandboxHost


class PoolOwner(Protocol):
    """What pools need of the node's FnCall service (service.py), without importing it."""

    host: "SandboxHost"
    project: str
    settings: "FnCallSettings"
    probes: Any
    closing: bool

    def allocate_uid(self) -> int | None: ...
    def free_uid(self, uid: int) -> None: ...
    def allocate_cpu(self) -> int | None: ...
    def learn_languages(self, image: str, names: set[str]) -> None: ...

log = logging.getLogger("dsec.fncall")

ZYGOTE_PATH = "/fncall/zygote.py"
ZYGOTE_SOURCE = source("fncall_zygote.py").read_bytes()
LABEL = "dsec.fncall"
EXEC_CAP = 16 << 20           # the agent keeps at most this much of the zygote's stdout
COMPILED_HINTS = 256          # the zygote's compile cache keeps as many entries
FAIL_FAST_S = 5.0             # after a failed container start, callers get its error at once
# Zygotes of the python family: modules imported once, call processes forked with them loaded.
# A call forks from the first zygote that preloaded every module its code names (see
# insandbox/fncall_zygote.py), so `print(1)` forks from the small "base" and numpy code from "numpy". Fork and
# exit cost grows with the process: measured here 2.2 ms of CPU per print(1) call from "base"
# vs 2.8-3.0 ms from one zygote with all of these.
_BASE = ["math", "collections", "itertools", "functools", "heapq", "bisect", "re", "string",
         "operator", "copy", "array"]
_STD = _BASE + ["json", "random", "decimal", "fractions", "statistics", "datetime", "typing",
                "dataclasses", "threading"]
PYTHON_ZYGOTES = {"base": _BASE, "std": _STD, "numpy": _STD + ["numpy"]}


@dataclass(frozen=True)
class FnCallSettings:
    min_warm: int = 1                 # floor per pool while it is in use
    max_warm: int = 4                 # ceiling per pool
    max_calls: int = 1000             # calls before a container is replaced
    idle_s: float = 30.0              # a worker idle this long above the floor is retired
    keep_pool_s: float = 600.0        # without calls this long, the floor drops to 0
    max_starting: int = 2             # container starts in flight per pool
    container_cpu: float = 1.0
    container_memory_mb: int = 4096 + 512
    container_pids: int = 2048
    # call uids: one per worker, from here. Must lie inside the 65536 ids a container's user
    # namespace maps (backends/container/idmap.py): unmapped ids make chown() fail (EINVAL).
    uid_base: int = 20_000
    uid_count: int = 10_000
    stdout_budget: int = 12 << 20     # retire before the agent's EXEC_CAP is reached
    call_slack_s: float = 30.0        # beyond compile+run timeouts before a worker is presumed stuck
    # Pin each container's manager, zygotes and calls to one CPU (spread over the node's CPUs):
    # the per-call wake-ups between them stay on one CPU. Measured +12-16% calls/s for print(1)
    # on 2 cores. A container is limited to container_cpu (1 core) by its CFS quota anyway.
    pin_cpu: bool = True

    @classmethod
    def from_settings(cls, s: FnCallEnvSettings) -> "FnCallSettings":
        """The DSEC_FNCALL_* settings; max_warm unset: twice the cores, at least 2."""
        max_warm = s.max_warm if s.max_warm is not None else max(2, 2 * (os.cpu_count() or 1))
        return cls(min_warm=s.min_warm, max_warm=max_warm, max_calls=s.max_calls, idle_s=s.idle_s,
                   keep_pool_s=s.keep_pool_s, pin_cpu=s.pin_cpu)


class Worker:
    """One warm container and its zygote."""

    def __init__(self, pool: "Pool", uid: int, cpu: int | None = None):
        self.pool = pool
        self.uid = uid
        self.cpu = cpu            # the container's call chain runs on this CPU (None: anywhere)
        self.sandbox_id: str | None = None
        self.languages: set[str] = set()
        self.calls = 0
        self.stdout_total = 0
        self.last_used = time.monotonic()
        self.ready = asyncio.Event()
        self.was_ready = False
        self.dead = False
        self.retiring: str | None = None
        self.start_error: DsecError | None = None
        self._agent: Any = None
        self._chan = 0
        self._buf = bytearray()
        self._stderr = b""
        self._pending: dict[int, asyncio.Future] = {}
        self._orphan: int | None = None       # a call whose caller went away; release on its result
        self._inflight: int | None = None     # the call the zygote is running
        self.compiled: OrderedDict[str, None] = OrderedDict()   # compile-cache keys (a hint)
        self.task: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"Worker({self.sandbox_id}, uid={self.uid}, calls={self.calls})"

    @property
    def usable(self) -> bool:
        return self.ready.is_set() and not self.dead and self.retiring is None

    # -- lifecycle (one task per worker, owned by the pool) --------------------------------
    async def run(self) -> None:
        svc = self.pool.service
        host = svc.host
        reason = "worker ended"
        try:
            s = svc.settings
            info = await host.create(svc.project, ContainerArgs(
                image=self.pool.image, cpu_cores=s.container_cpu, memory_mb=s.container_memory_mb,
                pids_limit=s.container_pids, ttl_idle_s=3600, user="root", workdir="/fncall",
                labels={LABEL: f"{self.pool.image}/{self.pool.family}"}))
            self.sandbox_id = info.id
            await host.write_file(info.id, ZYGOTE_PATH, ZYGOTE_SOURCE, mode=0o644, mkdirs=True)
            python = self.pool.family == "python"
            cfg = {"uid": self.uid, "gid": self.uid, "probes": svc.probes,
                   "zygotes": PYTHON_ZYGOTES if python else {"base": []},
                   "work_on_shm": python,   # no compiled programs: tmpfs work dirs (noexec there)
                   "cpu": self.cpu,
                   "zygote_env": {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}}
            cmd = f"exec python3 -I {ZYGOTE_PATH} {shlex.quote(json.dumps(cfg))}"
            async with host.agent_channel(info.id) as (agent, chan):
                self._agent, self._chan = agent, chan
                events = agent.exec(chan, cmd=cmd, uid=0, gid=0, cwd="/fncall", cap=EXEC_CAP,
                                    keep_stdin=True)
                async for item in events:
                    if isinstance(item, Output):
                        if item.stream == "stdout":
                            self.stdout_total += len(item.data)
                            self._feed(item.data)
                        else:
                            self._stderr = (self._stderr + item.data)[-2000:]
                            log.warning("fncall zygote stderr", extra={"sandbox": info.id,
                                        "text": item.data[-2000:].decode(errors="replace")})
                    elif isinstance(item, Exit):
                        reason = f"zygote exited (code {item.exit_code}, signal {item.signal})"
                        break
            if not self.was_ready and self.start_error is None:
                tail = self._stderr.decode(errors="replace").strip()[-500:]
                self.start_error = InvalidArgument(
                    f"image {self.pool.image!r} cannot host FnCall pools: the zygote exited before it was "
                    f"ready ({reason})" + (f": {tail}" if tail else ""), field="image",
                    fix=f"use an image with python3, e.g. {FNCALL_DEFAULT_IMAGE}")
        except asyncio.CancelledError:
            reason = self.retiring or "pool closed"
            raise
        except DsecError as e:
            reason = f"worker failed: {e.message}"
            if not self.ready.is_set():
                self.start_error = e
        except Exception as e:   # a broken worker must never take the pool down
            reason = f"worker failed: {e!r}"
            if not self.ready.is_set():
                self.start_error = SandboxFailed(f"could not start a warm container: {e!r}")
            log.exception("fncall worker failed", extra={"sandbox": self.sandbox_id})
        finally:
            self.dead = True
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(SandboxFailed(f"the warm container went away: {reason}"))
            self._pending.clear()
            self.ready.set()   # wake anyone waiting for start-up
            self.pool.on_gone(self)
            try:
                if self.sandbox_id is not None:
                    await asyncio.shield(self._stop(f"fncall: {self.retiring or reason}"))
            finally:
                self.pool.service.free_uid(self.uid)

    async def _stop(self, reason: str) -> None:
        try:
            await self.pool.service.host.stop(self.sandbox_id, reason=reason)
        except Exception as e:
            log.warning("could not stop fncall container", extra={"sandbox": self.sandbox_id, "error": str(e)})

    def retire(self, reason: str) -> None:
        if self.retiring is None:
            self.retiring = reason
            log.info("retiring fncall container", extra={"sandbox": self.sandbox_id, "reason": reason,
                                                         "calls": self.calls})
        if self.task is not None and not self.task.done():
            self.task.cancel()

    # -- zygote protocol -----------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._buf += data
        while (nl := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:nl])
            del self._buf[:nl + 1]
            try:
                msg = json.loads(line)
            except ValueError:
                log.warning("bad line from fncall zygote", extra={"sandbox": self.sandbox_id, "line": line[:200]})
                continue
            self._on_message(msg)

    def _on_message(self, msg: dict) -> None:
        if msg.get("ready"):
            self.languages = set(msg.get("languages", []))
            self.pool.service.learn_languages(self.pool.image, self.languages)
            log.info("fncall container ready", extra={"sandbox": self.sandbox_id, "pool": self.pool.name,
                                                      "languages": sorted(self.languages),
                                                      "zygotes": msg.get("zygotes")})
            self.was_ready = True
            self.ready.set()
            self.pool.on_ready(self)
            return
        rid = msg.get("id")
        if rid is not None and rid == self._inflight:
            self._inflight = None
        if "fatal" in msg:
            log.error("fncall zygote failed", extra={"sandbox": self.sandbox_id, "error": msg["fatal"]})
            self.retiring = self.retiring or f"zygote failed: {msg['fatal']}"
        fut = self._pending.pop(rid, None) if rid is not None else None
        if fut is not None and not fut.done():
            fut.set_result(msg)
        elif rid is not None and rid == self._orphan:
            self._orphan = None
            self.pool.release(self, retire=None if msg.get("clean") else (msg.get("error") or "unclean"))

    async def call(self, payload: dict, timeout_s: float) -> dict:
        if not self.usable:
            raise SandboxFailed("the warm container is not usable")
        rid = payload["id"]
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._inflight = rid
        try:
            line = json.dumps(payload, separators=(",", ":")).encode() + b"\n"
            # shielded: a request cut in half by a cancelled caller would corrupt the next one
            await asyncio.shield(self._agent.send_stdin(self._chan, line))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._pending.pop(rid, None)

    def remember_compiled(self, key: str) -> None:
        self.compiled[key] = None
        self.compiled.move_to_end(key)
        while len(self.compiled) > COMPILED_HINTS:
            self.compiled.popitem(last=False)

    def release_when_done(self, rid: int) -> None:
        """The caller of call `rid` went away: hand the worker back once the zygote is done."""
        if self.dead or self._inflight != rid:     # gone, or the result is already in
            self.pool.release(self)
        else:
            self._orphan = rid


class Pool:
    def __init__(self, service: PoolOwner, image: str, family: str):
        self.service = service
        self.image = image
        self.family = family
        self.name = f"{image}/{family}"
        self.workers: set[Worker] = set()
        self.idle: list[Worker] = []
        self.waiters: deque[asyncio.Future] = deque()
        self.last_demand = time.monotonic()
        self.last_start_failure = 0.0
        self.last_error: DsecError | None = None    # why the last start failed (fail fast for a while)
        self.calls = 0

    @property
    def starting(self) -> int:
        return sum(1 for w in self.workers if not w.ready.is_set() and not w.dead)

    @property
    def settings(self) -> FnCallSettings:
        return self.service.settings

    def stats(self) -> dict:
        return {"pool": self.name, "workers": len(self.workers), "idle": len(self.idle),
                "starting": self.starting, "waiting": sum(1 for f in self.waiters if not f.done()),
                "calls": self.calls}

    # -- hand-out ------------------------------------------------------------------------
    async def acquire(self, prefer: str | None = None) -> Worker:
        """An idle worker (one that has `prefer` compiled, if any), else wait for one."""
        self.last_demand = time.monotonic()
        self.calls += 1
        if prefer is not None:
            for i in range(len(self.idle) - 1, -1, -1):
                w = self.idle[i]
                if prefer in w.compiled and w.usable:
                    del self.idle[i]
                    return w
        while self.idle:
            w = self.idle.pop()
            if w.usable:
                return w
        if (self.last_error is not None and time.monotonic() - self.last_start_failure < FAIL_FAST_S
                and not any(x.was_ready and not x.dead for x in self.workers)):
            raise self.last_error
        fut: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self._grow()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())
            raise

    def release(self, w: Worker, retire: str | None = None) -> None:
        w.last_used = time.monotonic()
        if w.dead:
            return
        if retire is None:
            s = self.settings
            if w.calls >= s.max_calls:
                retire = f"served max_calls={s.max_calls}"
            elif w.stdout_total >= s.stdout_budget:
                retire = "result channel near the agent's output cap"
            elif w.retiring:
                retire = w.retiring
        if retire is not None:
            w.retire(retire)
            self._grow()
            return
        self._offer(w)

    def _offer(self, w: Worker) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(w)
                return
        self.idle.append(w)

    # -- growth and shrinking ------------------------------------------------------------
    def _grow(self) -> None:
        s = self.settings
        now = time.monotonic()
        waiting = sum(1 for f in self.waiters if not f.done())
        if self.last_error is not None and (not waiting or now - self.last_start_failure < 1.0):
            return    # starts fail: only a caller that waits (after a pause) makes another try
        in_use = now - self.last_demand < s.keep_pool_s
        live = [w for w in self.workers if w.retiring is None and not w.dead]
        want = max(s.min_warm if in_use else 0, len(live) - self.starting + waiting)
        while len(live) < min(want, s.max_warm) and self.starting < s.max_starting:
            uid = self.service.allocate_uid()
            if uid is None:
                break
            w = Worker(self, uid, self.service.allocate_cpu())
            self.workers.add(w)
            live.append(w)
            w.task = asyncio.get_running_loop().create_task(w.run(), name=f"fncall-worker-{self.name}")

    def on_ready(self, w: Worker) -> None:
        self.last_error = None
        self._offer(w)
        self._grow()

    def on_gone(self, w: Worker) -> None:
        self.workers.discard(w)
        if w in self.idle:
            self.idle.remove(w)
        if w.start_error is not None and not w.was_ready:
            self.last_start_failure = time.monotonic()
            self.last_error = w.start_error
            if not any(not x.dead for x in self.workers):
                while self.waiters:   # nobody can serve them: tell them why
                    fut = self.waiters.popleft()
                    if not fut.done():
                        fut.set_exception(w.start_error)
                return
        if not self.service.closing:
            self._grow()

    def maintain(self) -> None:
        """Called about once a second: retire idle workers above the floor, keep the floor."""
        s = self.settings
        now = time.monotonic()
        in_use = now - self.last_demand < s.keep_pool_s
        floor = s.min_warm if in_use else 0
        live = [w for w in self.workers if w.retiring is None and not w.dead]
        for w in sorted(self.idle, key=lambda x: x.last_used):
            if len(live) <= floor:
                break
            if now - w.last_used > s.idle_s:
                self.idle.remove(w)
                live.remove(w)
                w.retire(f"idle for more than {s.idle_s:g}s")
        self._grow()

    async def close(self) -> None:
        for f in self.waiters:
            if not f.done():
                f.set_exception(Unavailable("the node is shutting down", fix="retry on another node"))
        self.waiters.clear()
        tasks = [w.task for w in self.workers if w.task is not None]
        for w in list(self.workers):
            w.retire("node shutting down")
        await asyncio.gather(*tasks, return_exceptions=True)
