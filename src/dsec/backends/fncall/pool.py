"""Warm pool containers for FnCall: one Worker per container, one Pool per (image, family).

A Worker is a container created through the edge's normal create path (owned by the system
project, so admission counts it) running the zygote (zygote.py) as one long-lived agent exec
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
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.agent.client import Exit, Output
from dsec.types import ContainerArgs, DsecError, SandboxFailed, Unavailable

if TYPE_CHECKING:
    from dsec.backends.fncall.service import FnCallService

log = logging.getLogger("dsec.fncall")

ZYGOTE_PATH = "/fncall/zygote.py"
ZYGOTE_SOURCE = Path(__file__).with_name("zygote.py").read_bytes()
LABEL = "dsec.fncall"
EXEC_CAP = 16 << 20           # the agent keeps at most this much of the zygote's stdout
START_TIMEOUT_S = 120.0
# Zygotes of the python family: modules imported once, call processes forked with them loaded.
# Code that names a module of the "numpy" zygote is forked from it; everything else from "base"
# (a smaller process forks faster: measured 1.1 vs 0.35 ms of CPU per fork here).
PYTHON_ZYGOTES = {
    "base": ["collections", "itertools", "functools", "heapq", "bisect", "math", "fractions",
             "decimal", "re", "json", "random", "string", "datetime", "typing", "dataclasses",
             "statistics", "copy", "operator", "array", "threading"],
    "numpy": ["numpy"],
}


def _env_num(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


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
    uid_base: int = 200_000           # call uids: one per worker, from here (host uids: no userns)
    uid_count: int = 10_000
    stdout_budget: int = 12 << 20     # retire before the agent's EXEC_CAP is reached
    call_slack_s: float = 30.0        # beyond compile+run timeouts before a worker is presumed stuck

    @classmethod
    def from_env(cls) -> "FnCallSettings":
        cores = os.cpu_count() or 1
        return cls(min_warm=int(_env_num("DSEC_FNCALL_MIN_WARM", 1)),
                   max_warm=int(_env_num("DSEC_FNCALL_MAX_WARM", max(2, 2 * cores))),
                   max_calls=int(_env_num("DSEC_FNCALL_MAX_CALLS", 1000)),
                   idle_s=_env_num("DSEC_FNCALL_IDLE_S", 30.0),
                   keep_pool_s=_env_num("DSEC_FNCALL_KEEP_POOL_S", 600.0))


class Worker:
    """One warm container and its zygote."""

    def __init__(self, pool: "Pool", uid: int):
        self.pool = pool
        self.uid = uid
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
        self._pending: dict[int, asyncio.Future] = {}
        self._orphan: int | None = None       # a call whose caller went away; release on its result
        self.task: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"Worker({self.sandbox_id}, uid={self.uid}, calls={self.calls})"

    @property
    def usable(self) -> bool:
        return self.ready.is_set() and not self.dead and self.retiring is None

    # -- lifecycle (one task per worker, owned by the pool) --------------------------------
    async def run(self) -> None:
        svc = self.pool.service
        edge = svc.edge
        reason = "worker ended"
        try:
            s = svc.settings
            info = await edge.create(svc.project, ContainerArgs(
                image=self.pool.image, cpu_cores=s.container_cpu, memory_mb=s.container_memory_mb,
                pids_limit=s.container_pids, ttl_idle_s=3600, user="root", workdir="/fncall",
                labels={LABEL: f"{self.pool.image}/{self.pool.family}"}))
            self.sandbox_id = info.id
            await edge.write_file(info.id, ZYGOTE_PATH, ZYGOTE_SOURCE, mode=0o644, mkdirs=True)
            python = self.pool.family == "python"
            cfg = {"uid": self.uid, "gid": self.uid, "probes": svc.probes,
                   "zygotes": PYTHON_ZYGOTES if python else {"base": []},
                   "work_on_shm": python,   # no compiled programs: tmpfs work dirs (noexec there)
                   "zygote_env": {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}}
            cmd = f"exec python3 -I {ZYGOTE_PATH} {shlex.quote(json.dumps(cfg))}"
            async with edge.agent_channel(info.id) as (agent, chan):
                self._agent, self._chan = agent, chan
                events = agent.exec(chan, cmd=cmd, uid=0, gid=0, cwd="/fncall", cap=EXEC_CAP,
                                    keep_stdin=True)
                async for item in events:
                    if isinstance(item, Output):
                        if item.stream == "stdout":
                            self.stdout_total += len(item.data)
                            self._feed(item.data)
                        else:
                            log.warning("fncall zygote stderr", extra={"sandbox": info.id,
                                        "text": item.data[-2000:].decode(errors="replace")})
                    elif isinstance(item, Exit):
                        reason = f"zygote exited (code {item.exit_code}, signal {item.signal})"
                        break
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
            await self.pool.service.edge.stop(self.sandbox_id, reason=reason)
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
        try:
            line = json.dumps(payload, separators=(",", ":")).encode() + b"\n"
            await self._agent.send_stdin(self._chan, line)
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._pending.pop(rid, None)

    def release_when_done(self, rid: int) -> None:
        """The caller of call `rid` went away: hand the worker back once the zygote is done."""
        if self.dead:
            self.pool.release(self)
        else:
            self._orphan = rid


class Pool:
    def __init__(self, service: "FnCallService", image: str, family: str):
        self.service = service
        self.image = image
        self.family = family
        self.name = f"{image}/{family}"
        self.workers: set[Worker] = set()
        self.idle: list[Worker] = []
        self.waiters: deque[asyncio.Future] = deque()
        self.last_demand = time.monotonic()
        self.last_start_failure = 0.0
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
    async def acquire(self) -> Worker:
        self.last_demand = time.monotonic()
        self.calls += 1
        while self.idle:
            w = self.idle.pop()
            if w.usable:
                return w
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
        waiting = sum(1 for f in self.waiters if not f.done())
        in_use = time.monotonic() - self.last_demand < s.keep_pool_s
        live = [w for w in self.workers if w.retiring is None and not w.dead]
        want = max(s.min_warm if in_use else 0, len(live) - self.starting + waiting)
        if waiting and time.monotonic() - self.last_start_failure < 1.0:
            return    # back off after a failed start; waiters were told why
        while len(live) < min(want, s.max_warm) and self.starting < s.max_starting:
            uid = self.service.allocate_uid()
            if uid is None:
                break
            w = Worker(self, uid)
            self.workers.add(w)
            live.append(w)
            w.task = asyncio.get_running_loop().create_task(w.run(), name=f"fncall-worker-{self.name}")

    def on_ready(self, w: Worker) -> None:
        self._offer(w)

    def on_gone(self, w: Worker) -> None:
        self.workers.discard(w)
        if w in self.idle:
            self.idle.remove(w)
        if w.start_error is not None and not w.was_ready:
            self.last_start_failure = time.monotonic()
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
