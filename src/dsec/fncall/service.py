"""FnCallService: the FnCall backend on one node, beside its edge (a SandboxHost, host.py).

It resolves the language, picks the pool for (image, language family), runs the call in a warm
worker and turns the zygote's raw answer into an FnCallResult with one status. Invalid input
(unknown language, a language the image lacks, a missing image) raises before anything runs;
failures of the platform during a call come back as status sandbox-error for that call only.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from dsec.agent.client import AgentDisconnected, AgentError
from dsec.fncall import languages as langs
from dsec.fncall.pool import LABEL, FnCallSettings, Pool, Worker
from dsec.settings import FnCallEnvSettings
from dsec.types import (DsecError, FnCallRequest, FnCallResult, FnCallStatus, FnCallStep,
                        InvalidArgument, SandboxFailed, SandboxState)

if TYPE_CHECKING:
    from dsec.fncall.host import SandboxHost

log = logging.getLogger("dsec.fncall")

INLINE_MAX = 64 << 10          # outputs up to this size come inline in the result line
FETCH_MAX = 16 << 20           # fetched files, all together
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "USER": "fncall", "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
MEMORY_HINTS = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "out of memory",
                "OutOfMemoryError", "heap out of memory")


class FnCallService:
    def __init__(self, host: "SandboxHost", project: str, settings: FnCallSettings | None = None):
        self.host = host
        self.project = project
        self.settings = settings or FnCallSettings.from_settings(FnCallEnvSettings())
        self.probes = langs.probes()
        self.pools: dict[tuple[str, str], Pool] = {}
        self.closing = False
        self._languages: dict[str, set[str]] = {}
        self._ids = itertools.count(1)
        self._free_uids: list[int] = []
        self._next_uid = 0
        self._known_images: set[str] = set()
        self._maintainer: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Stop pool containers a previous edge left behind (pools start again on demand)."""
        for info in await self.host.list(self.project):
            if LABEL in info.labels and info.state == SandboxState.running:
                await self.host.stop(info.id, reason="fncall: left over from a previous edge")
        self._maintainer = asyncio.create_task(self._maintain_loop(), name="fncall-maintainer")

    async def close(self) -> None:
        self.closing = True
        if self._maintainer is not None:
            self._maintainer.cancel()
            await asyncio.gather(self._maintainer, return_exceptions=True)
        await asyncio.gather(*(p.close() for p in self.pools.values()), return_exceptions=True)

    async def _maintain_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for pool in list(self.pools.values()):
                try:
                    pool.maintain()
                except Exception:
                    log.exception("fncall pool maintenance failed", extra={"pool": pool.name})

    async def pool_stats(self) -> list[dict]:
        """Per pool: workers, idle, starting, waiting callers, calls served."""
        return [p.stats() for p in self.pools.values()]

    # -- uids: one per worker, unique on the node (processes of a uid are killed by uid) ----
    def allocate_uid(self) -> int | None:
        if self._free_uids:
            return self._free_uids.pop()
        if self._next_uid >= self.settings.uid_count:
            return None
        uid = self.settings.uid_base + self._next_uid
        self._next_uid += 1
        return uid

    def free_uid(self, uid: int) -> None:
        self._free_uids.insert(0, uid)   # reuse the longest-free first

    def allocate_cpu(self) -> int | None:
        """The CPU (of those this process may use) with the fewest live workers pinned to it."""
        if not self.settings.pin_cpu:
            return None
        cpus = sorted(os.sched_getaffinity(0))
        load = {c: 0 for c in cpus}
        for pool in self.pools.values():
            for w in pool.workers:
                if w.cpu in load and not w.dead:
                    load[w.cpu] += 1
        return min(cpus, key=lambda c: (load[c], c))

    def learn_languages(self, image: str, names: set[str]) -> None:
        self._languages[image] = set(names)

    # -- calls ---------------------------------------------------------------------------
    async def _pool(self, image: str, family: str) -> Pool:
        if image not in self._known_images:
            await self.host.resolve_image(image)   # NotFound names the field
            self._known_images.add(image)
        pool = self.pools.get((image, family))
        if pool is None:
            pool = self.pools[(image, family)] = Pool(self, image, family)
        return pool

    def _check_language(self, lang: langs.Language, image: str, available: set[str] | None) -> None:
        if available is not None and lang.name not in available:
            raise InvalidArgument(f"language {lang.name!r} is not available in image {image!r}",
                                  field="language",
                                  fix=f"use one of {', '.join(sorted(available))}, or an image that has "
                                      f"{', '.join(lang.needs)} (the built-in {langs.POLYGLOT_IMAGE!r} has)")

    async def warm(self, image: str, language: str = "python") -> None:
        """Make sure the pool for (image, language) has a ready worker."""
        w = await self._acquire(image, langs.resolve(language))
        w.pool.release(w)

    async def _acquire(self, image: str, lang: langs.Language, prefer: str | None = None) -> Worker:
        self._check_language(lang, image, self._languages.get(image))
        pool = await self._pool(image, lang.family)
        w = await pool.acquire(prefer)
        if lang.name not in w.languages:
            pool.release(w)
            self._check_language(lang, image, w.languages)
        return w

    async def run(self, req: FnCallRequest, project: str | None = None) -> FnCallResult:
        """Run one call for `project` (the caller's: compile-cache entries are its own)."""
        t0 = time.monotonic()
        lang = langs.resolve(req.language)
        rid = next(self._ids)
        payload = build_payload(req, lang, rid, project=project)
        w = await self._acquire(req.image, lang, prefer=payload["cache_key"])
        queued = time.monotonic() - t0
        timeout = req.timeout_s + (req.compile_timeout_s if lang.compile else 0) + self.settings.call_slack_s
        w.calls += 1
        try:
            raw = await w.call(payload, timeout)
            if "fatal" in raw:
                raise SandboxFailed(f"the warm container failed: {raw['fatal']}")
            blobs = await self._fetch_blobs(w, raw)
        except asyncio.CancelledError:
            w.release_when_done(rid)
            raise
        except asyncio.TimeoutError:
            w.pool.release(w, retire="a call did not finish in time")
            return _failed(lang, f"the call did not finish within {timeout:g}s on {w.sandbox_id}", queued, t0, w)
        except (DsecError, AgentDisconnected, AgentError, OSError) as e:
            w.pool.release(w, retire=f"call failed: {e}")
            return _failed(lang, f"{e}", queued, t0, w)
        if raw.get("cache") and payload["cache_key"]:
            w.remember_compiled(payload["cache_key"])
        w.pool.release(w, retire=None if raw.get("clean") else (raw.get("error") or "cleanup failed"))
        res = to_result(raw, lang, blobs)
        res.queue_s, res.total_s, res.executor = queued, time.monotonic() - t0, w.sandbox_id
        return res

    async def _fetch_blobs(self, w: Worker, raw: dict) -> dict[str, bytes]:
        """Outputs too large for the result line, read with FILE_READ before the next call."""
        paths = [b["path"] for st in raw.get("steps", []) for b in (st["stdout"], st["stderr"]) if "path" in b]
        paths += [b["path"] for b in raw.get("files", {}).values() if "path" in b]
        out = {}
        for p in paths:
            out[p] = await self.host.read_file(w.sandbox_id, p, maxlen=FETCH_MAX + INLINE_MAX)
        return out


def compile_cache_key(project: str | None, req: FnCallRequest, lang: langs.Language, argv: list[str],
                      env: dict[str, str], files: dict[str, str]) -> str:
    """The compile cache's key: everything the compile step's output can depend on (the
    compiler argv, the whole environment: SOURCE_DATE_EPOCH, CPATH, JAVA_TOOL_OPTIONS, ... all
    reach the compiler; the code and files; the image), and the caller's project, so no project
    gets another's artifacts or learns from `compile.cached` what another compiled."""
    blob = json.dumps({"v": 2, "project": project, "image": req.image, "language": lang.name, "argv": argv,
                       "env": sorted(env.items()), "code": req.code, "files": sorted(files.items())})
    return hashlib.sha256(blob.encode()).hexdigest()


def build_payload(req: FnCallRequest, lang: langs.Language, rid: int, *, project: str | None = None) -> dict:
    steps = []
    src = langs.source_file(lang, req.code)
    if lang.compile:
        # runtimes that reserve huge virtual ranges (javac's JVM, node) compile without RLIMIT_AS
        steps.append({"name": "compile", "argv": langs.expand(lang.compile, lang, req.memory_mb, src),
                      "timeout_s": req.compile_timeout_s,
                      "memory_mb": max(lang.compile_memory_mb, req.memory_mb),
                      "limit_address_space": lang.limit_address_space, "stdin": False})
    run = None if lang.run is None else langs.expand(lang.run, lang, req.memory_mb, src) + list(req.args)
    steps.append({"name": "run", "argv": run, "timeout_s": req.timeout_s, "memory_mb": req.memory_mb,
                  "limit_address_space": lang.limit_address_space, "stdin": True})
    files = {k: base64.b64encode(v.encode()).decode() for k, v in req.files.items()}
    files.update(req.files_b64)
    if src in files:
        raise InvalidArgument(f"files must not contain {src!r}: the code goes there",
                              field="files", fix="pass the program as `code`")
    env = {**BASE_ENV, **lang.env, **req.env}
    key = None
    if lang.compile:   # same program, inputs and project: compiled once per container
        key = compile_cache_key(project, req, lang, steps[0]["argv"], env, files)
    code = req.code
    if lang.code_prefix and lang.code_prefix not in code:
        code = lang.code_prefix + "\n" + code
    return {"id": rid, "source": src, "code": code, "files": files,
            "cache_key": key, "artifacts": list(lang.artifacts),
            "stdin": base64.b64encode(req.stdin.encode()).decode() if req.stdin is not None else None,
            "steps": steps, "env": env, "args": list(req.args),
            "max_processes": max(req.max_processes, lang.min_processes), "max_file_mb": req.max_file_mb,
            "output_cap": req.output_cap_bytes, "inline_max": INLINE_MAX,
            "fetch": list(req.fetch_files), "fetch_max": FETCH_MAX}


def _blob(b: dict, blobs: dict[str, bytes]) -> bytes:
    return base64.b64decode(b["b64"]) if "b64" in b else blobs.get(b["path"], b"")


def _step(raw: dict, blobs: dict[str, bytes]) -> FnCallStep:
    return FnCallStep(exit_code=raw["exit_code"], signal=raw["signal"], timed_out=raw["timed_out"],
                      cached=raw.get("cached", False),
                      output_limited=raw["output_limited"],
                      stdout=_blob(raw["stdout"], blobs).decode(errors="replace"),
                      stderr=_blob(raw["stderr"], blobs).decode(errors="replace"),
                      stdout_bytes=raw["stdout_bytes"], stderr_bytes=raw["stderr_bytes"],
                      wall_s=raw["wall_s"], cpu_s=raw["cpu_s"], max_rss_mb=raw["max_rss_kb"] / 1024)


def _memory_hit(raw: dict, step: FnCallStep) -> bool:
    if raw.get("python") == "memory":
        return True
    if step.signal == signal.SIGKILL and not step.timed_out and not step.output_limited:
        return True    # the container's OOM killer
    failed = step.exit_code not in (0, None) or step.signal is not None
    return failed and any(h in step.stderr[-4096:] for h in MEMORY_HINTS)


def to_result(raw: dict, lang: langs.Language, blobs: dict[str, bytes]) -> FnCallResult:
    steps = {st["name"]: st for st in raw.get("steps", [])}
    comp = _step(steps["compile"], blobs) if "compile" in steps else None
    run = _step(steps["run"], blobs) if "run" in steps else None
    files = {rel: base64.b64encode(_blob(b, blobs)).decode() for rel, b in raw.get("files", {}).items()}
    last = run or comp
    res = FnCallResult(status=FnCallStatus.sandbox_error, compile=comp, run=run, files=files,
                       language=lang.name, error=raw.get("error"))
    if last is not None:
        res.exit_code, res.signal, res.stdout, res.stderr = last.exit_code, last.signal, last.stdout, last.stderr
    if run is not None:
        res.wall_s, res.cpu_s = run.wall_s, run.cpu_s
    if comp is not None and run is None:
        if comp.timed_out:
            res.status = FnCallStatus.timeout
        elif comp.output_limited:
            res.status = FnCallStatus.output_limit
        else:
            res.status = FnCallStatus.compile_error
    elif run is not None:
        if run.timed_out or run.signal == signal.SIGXCPU:
            res.status = FnCallStatus.timeout
        elif run.output_limited:
            res.status = FnCallStatus.output_limit
        elif steps["run"].get("python") == "syntax":
            res.status = FnCallStatus.compile_error
        elif _memory_hit(steps["run"], run):
            res.status = FnCallStatus.memory
        elif run.exit_code != 0:
            res.status = FnCallStatus.runtime_error
        else:
            res.status = FnCallStatus.ok
    return res


def _failed(lang: langs.Language, error: str, queued: float, t0: float, w: Worker | None) -> FnCallResult:
    return FnCallResult(status=FnCallStatus.sandbox_error, language=lang.name, error=error, queue_s=queued,
                        total_s=time.monotonic() - t0, executor=w.sandbox_id if w else None)
