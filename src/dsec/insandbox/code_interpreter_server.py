#!/usr/bin/python3
"""dsec-code-interpreter: the HTTP server that `e2b_code_interpreter` talks to on port 49999.

Runs inside a sandbox of the `code-interpreter` image (dsec/images/builtin.py installs it as
/usr/local/bin/dsec-code-interpreter) with the image's /usr/bin/python3: standard library plus
Debian's jupyter_client (and ipykernel for the kernels). It never imports dsec.

This is a re-implementation, written from reading the e2b_code_interpreter 2.11.5 Python client
(code_interpreter_sync.py, code_interpreter_async.py, models.py, constants.py): the paths, the
request bodies and the NDJSON lines its `parse_output` understands. No code is copied from E2B.

Protocol (what that client sends and parses):

  POST /execute  {"code": str, "context_id": str|null, "language": str|null,
                  "env_vars": {str: str}|null, "timeout": seconds|null (dsec's, optional)}
      200, Content-Type application/x-ndjson, chunked; one JSON object per line, as the
      execution goes:
        {"type": "stdout"|"stderr", "text": str, "timestamp": unix ns}
        {"type": "number_of_executions", "execution_count": int}
        {"type": "result", "is_main_result": bool, "text", "html", "markdown", "svg", "png",
         "jpeg", "pdf", "latex", "json", "javascript": the MIME bundle's entries (only those
         present), "extra": {other MIME type: value}}   (execute_result: main; display_data: not)
        {"type": "error", "name": str, "value": str, "traceback": str}
        {"type": "end_of_execution"}
      404 unknown context_id, 400 a bad body or a language without a kernel here, 500 the
      kernel could not be started (the body says why).
  POST   /contexts                {"language"?: "python", "cwd"?: str} -> {"id", "language", "cwd"}
  GET    /contexts                -> [{"id", "language", "cwd"}, ...]
  DELETE /contexts/{id}           -> 204 (404 when unknown)
  POST   /contexts/{id}/restart   -> 204: a fresh kernel, the state is gone
  GET    /health                  -> {"status": "ok"}

One Jupyter kernel (ipykernel, started with jupyter_client's KernelManager) per context; the
default context ("python", used when a request names neither context nor language) is started
in the background as soon as the port listens, so the first execution finds it warm. Each
context has one worker thread that owns its kernel manager and client (jupyter_client's sync
API is not thread-safe); executions in a context run one at a time, in arrival order.

Executions end early when:
  - the HTTP client goes away (e2b's `timeout` closes the connection): the kernel is
    interrupted (SIGINT), its state is kept;
  - the request's `timeout` (or --timeout) passes: interrupted, reported as a TimeoutError;
  - the kernel dies (os._exit, OOM kill, ...): reported as a DeadKernelError and a fresh
    kernel is started (the state is lost); a kernel that ignores the interrupt for
    INTERRUPT_GRACE_S is killed and restarted the same way.

Start-up: `dsec-code-interpreter --daemon` binds 0.0.0.0:49999, forks the server into the
background (new session, output to --log) and exits 0 once the port listens, so whoever runs it
(e.g. the E2B layer right after creating the sandbox) knows the port is up when it returns.
Without --daemon it serves in the foreground.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import re
import select
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("dsec-code-interpreter")

PORT = 49999
DEFAULT_CONTEXT_ID = "python"
# language -> kernel name: python always (ipykernel); the others as their kernelspecs are found
# at start (find_languages): r (Debian's IRkernel), javascript and bash (dsec's, see
# code_interpreter_kernels.py)
LANGUAGES = {"python": "python3"}
ALIASES = {"python3": "python", "js": "javascript", "sh": "bash", "R": "r"}
KERNEL_DIRS = ("/usr/local/share/jupyter/kernels", "/usr/share/jupyter/kernels")
MAX_CONTEXTS = 32
MAX_BODY_BYTES = 16 * 1024 * 1024
KERNEL_READY_S = 60.0            # a kernel that is not answering by then failed to start
INTERRUPT_GRACE_S = 10.0         # an interrupted kernel still busy after this is killed
POLL_S = 0.2                     # how often a waiting execution checks the kernel and the client

# Jupyter MIME type -> the field of the client's Result
MIME_FIELDS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
    "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
    "application/json": "json", "application/javascript": "javascript",
}
BASE64_FIELDS = {"png", "jpeg", "pdf"}

# Run silently in the kernel around an execution with env_vars: set them, then put back what
# was there (kept out of the user's names: on Python's os module, JavaScript's globalThis,
# bash's __dsec_old_* variables, R's .dsec_saved_env).
SET_ENV = ("(lambda o, e: (setattr(o, '_dsec_saved_env', {k: o.environ.get(k) for k in e}), "
           "o.environ.update(e)))(__import__('os'), %r)")
RESTORE_ENV = ("(lambda o: [o.environ.pop(k, None) if v is None else o.environ.__setitem__(k, v) "
               "for k, v in o.__dict__.pop('_dsec_saved_env', {}).items()])(__import__('os'))")
BASH_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def env_code(language: str, env: dict[str, str]) -> tuple[str, str]:
    """(set, restore): the code that sets env in a kernel of `language`, and the code that puts
    back what was there."""
    if language == "python":
        return SET_ENV % (env,), RESTORE_ENV
    if language == "javascript":
        return (f"(e => {{ globalThis.__dsecSavedEnv = Object.fromEntries(Object.keys(e).map(k => "
                f"[k, process.env[k]])); Object.assign(process.env, e); }})({json.dumps(env)})",
                "for (const [k, v] of Object.entries(globalThis.__dsecSavedEnv || {})) "
                "{ if (v === undefined) delete process.env[k]; else process.env[k] = v; } "
                "delete globalThis.__dsecSavedEnv")
    if language == "bash":
        bad = [k for k in env if not BASH_NAME.match(k)]
        if bad:
            raise HTTPError(400, f"env_vars: {bad[0]!r} is not a shell variable name (letters, digits, _)")
        return ("; ".join(f'if [ -n "${{{k}+x}}" ]; then __dsec_old_{k}=${k}; else unset __dsec_old_{k}; fi; '
                          f"export {k}={shlex.quote(v)}" for k, v in env.items()),
                "; ".join(f'if [ -n "${{__dsec_old_{k}+x}}" ]; then export {k}="$__dsec_old_{k}"; '
                          f"else unset {k}; fi; unset __dsec_old_{k}" for k in env))
    if language == "r":
        names = ", ".join(json.dumps(k) for k in env)
        pairs = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in env.items())
        return (f".dsec_saved_env <- Sys.getenv(c({names}), unset = NA, names = TRUE); "
                f"do.call(Sys.setenv, as.list(c({pairs})))",
                "for (k in names(.dsec_saved_env)) if (is.na(.dsec_saved_env[[k]])) Sys.unsetenv(k) "
                "else do.call(Sys.setenv, setNames(list(.dsec_saved_env[[k]]), k)); rm(.dsec_saved_env)")
    raise HTTPError(400, f"env_vars are not supported in {language} contexts; set them in the code")


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _now_ns() -> int:
    return time.time_ns()


def result_line(data: dict, main: bool) -> dict:
    """A display_data / execute_result MIME bundle as the client's `result` line."""
    out: dict = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
            continue
        if isinstance(value, list):          # nbformat allows multi-line strings as lists
            value = "".join(value)
        if field in BASE64_FIELDS and isinstance(value, str):
            value = "".join(value.split())
        out[field] = value
    if extra:
        out["extra"] = extra
    return out


# ---------------------------------------------------------------------------------------
# One context = one kernel, owned by one worker thread
# ---------------------------------------------------------------------------------------


class Job:
    """An execution handed to a context's worker; events flow back to the HTTP thread."""

    def __init__(self, code: str, env_vars: dict[str, str] | None, timeout: float | None):
        self.code = code
        self.env_vars = env_vars
        self.timeout = timeout
        self.events: queue.Queue = queue.Queue()    # ("ready",) ("line", dict) ("fail", status, msg) ("done",)
        self.cancel = threading.Event()


class Context:
    def __init__(self, context_id: str, language: str, cwd: str):
        self.id = context_id
        self.language = language
        self.cwd = cwd
        self.km = None
        self.kc = None
        self.jobs: queue.Queue = queue.Queue()
        self.closed = False
        self.thread = threading.Thread(target=self._work, name=f"context-{context_id}", daemon=True)
        self.thread.start()

    def describe(self) -> dict:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    # ---- called from HTTP threads -------------------------------------------------------

    def call(self, fn, timeout: float | None = None):
        """Run fn(self) on the worker thread and return its result (or raise its error)."""
        box: queue.Queue = queue.Queue()
        self.jobs.put(("call", fn, box))
        ok, value = box.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def submit(self, job: Job) -> None:
        if self.closed:
            raise HTTPError(404, f"context {self.id!r} was removed")
        self.jobs.put(("exec", job))

    def close(self) -> None:
        self.closed = True
        self.jobs.put(("stop",))

    # ---- the worker thread --------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self.jobs.get()
            if item[0] == "stop":
                self._stop_kernel()
                self._refuse_the_rest()
                return
            if item[0] == "call":
                _, fn, box = item
                try:
                    box.put((True, fn(self)))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    box.put((False, e))
                continue
            job = item[1]
            try:
                self._execute(job)
            except Exception as e:  # reported to the client
                log.exception("execution failed in context %s", self.id)
                job.events.put(("line", {"type": "error", "name": type(e).__name__, "value": str(e),
                                         "traceback": f"{type(e).__name__}: {e}"}))
            finally:
                job.events.put(("done",))

    def _refuse_the_rest(self) -> None:
        """Jobs that raced with the removal of this context."""
        while True:
            try:
                item = self.jobs.get_nowait()
            except queue.Empty:
                return
            if item[0] == "exec":
                item[1].events.put(("fail", 404, f"context {self.id!r} was removed"))
            elif item[0] == "call":
                item[2].put((False, HTTPError(404, f"context {self.id!r} was removed")))

    def ensure_kernel(self) -> None:
        if self.km is not None:
            if self.km.is_alive():
                return
            self._stop_kernel()
        self._start_kernel()

    def _start_kernel(self) -> None:
        # a slow import (zmq, tornado, traitlets): only here, in the worker, after the port listens
        from jupyter_client.manager import KernelManager
        t0 = time.monotonic()
        km = KernelManager(kernel_name=LANGUAGES[self.language])
        km.start_kernel(cwd=self.cwd, env=kernel_env())
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=KERNEL_READY_S)
        except BaseException:
            kc.stop_channels()
            _quiet(km.shutdown_kernel, now=True)
            raise
        self.km, self.kc = km, kc
        log.info("context %s: kernel ready in %.2fs (pid %s)", self.id, time.monotonic() - t0, kernel_pid(km))

    def _stop_kernel(self) -> None:
        kc, km, self.kc, self.km = self.kc, self.km, None, None
        if kc is not None:
            _quiet(kc.stop_channels)
        if km is not None:
            _quiet(km.shutdown_kernel, now=True)

    def restart(self) -> None:
        self._stop_kernel()
        self._start_kernel()

    def _drain_shell(self) -> None:
        """Drop the execute_replies of earlier executions (their iopub messages said it all)."""
        while True:
            try:
                self.kc.get_shell_msg(timeout=0)
            except queue.Empty:
                return

    def _silent(self, code: str) -> None:
        """Run code without output or history and wait for it (bounded)."""
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                reply = self.kc.get_shell_msg(timeout=POLL_S)
            except queue.Empty:
                if not self.km.is_alive():
                    return
                continue
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return

    def _execute(self, job: Job) -> None:
        if job.cancel.is_set():
            return
        try:
            self.ensure_kernel()
        except Exception as e:  # the client's 500
            log.exception("context %s: kernel did not start", self.id)
            job.events.put(("fail", 500, f"the {self.language} kernel did not start: {type(e).__name__}: {e}"))
            return
        env = None
        if job.env_vars:
            try:
                env = env_code(self.language, {str(k): str(v) for k, v in job.env_vars.items()})
            except HTTPError as e:
                job.events.put(("fail", e.status, e.message))
                return
        job.events.put(("ready",))
        self._drain_shell()
        if env:
            self._silent(env[0])
        try:
            self._run(job)
        finally:
            if env and self.km is not None and self.km.is_alive():
                self._silent(env[1])

    def _run(self, job: Job) -> None:
        emit = lambda line: job.events.put(("line", line))
        # stop_on_error=False: this server never queues executions in a kernel (one at a time
        # per context), and with True ipykernel aborts whatever arrives in a short window after
        # an error: under load, the next execution (or the silent env_vars code) came back empty
        msg_id = self.kc.execute(job.code, silent=False, store_history=True, allow_stdin=False,
                                 stop_on_error=False)
        deadline = time.monotonic() + job.timeout if job.timeout else None
        interrupted_at = None
        why = None                                      # None, "timeout" or "cancel"
        while True:
            now = time.monotonic()
            if interrupted_at is None:
                if job.cancel.is_set():
                    why = "cancel"
                elif deadline is not None and now >= deadline:
                    why = "timeout"
                if why:
                    log.info("context %s: interrupting the execution (%s)", self.id, why)
                    _quiet(self.km.interrupt_kernel)
                    interrupted_at = now
            elif now - interrupted_at > INTERRUPT_GRACE_S:
                self._report_restart(emit, f"the kernel did not stop within {INTERRUPT_GRACE_S:g}s of "
                                           "an interrupt; it was killed and restarted, its state is lost",
                                     "TimeoutError" if why == "timeout" else "KernelRestarted")
                return
            try:
                msg = self.kc.get_iopub_msg(timeout=POLL_S)
            except queue.Empty:
                if not self.km.is_alive():
                    code = kernel_exit_code(self.km)
                    self._report_restart(emit, f"the kernel died{'' if code is None else f' (exit status {code})'}"
                                               " while running this code; a new one was started, its state "
                                               "is lost", "DeadKernelError")
                    return
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                name = "stderr" if content.get("name") == "stderr" else "stdout"
                emit({"type": name, "text": content.get("text", ""), "timestamp": _now_ns()})
            elif kind == "execute_input":
                if content.get("execution_count") is not None:
                    emit({"type": "number_of_executions", "execution_count": content["execution_count"]})
            elif kind == "execute_result":
                emit(result_line(content.get("data", {}), True))
            elif kind == "display_data":
                emit(result_line(content.get("data", {}), False))
            elif kind == "error":
                if why == "timeout" and content.get("ename") == "KeyboardInterrupt":
                    emit({"type": "error", "name": "TimeoutError",
                          "value": f"execution exceeded its timeout of {job.timeout:g}s and was interrupted",
                          "traceback": "\n".join(content.get("traceback", []))})
                else:
                    emit({"type": "error", "name": content.get("ename", ""), "value": content.get("evalue", ""),
                          "traceback": "\n".join(content.get("traceback", []))})
            elif kind == "status" and content.get("execution_state") == "idle":
                return

    def _report_restart(self, emit, value: str, name: str) -> None:
        log.warning("context %s: %s", self.id, value)
        emit({"type": "error", "name": name, "value": value, "traceback": f"{name}: {value}"})
        self._stop_kernel()
        try:
            self._start_kernel()
        except Exception:  # the next execution retries
            log.exception("context %s: restarting the kernel failed", self.id)


def _quiet(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception:  # best effort clean-up
        log.debug("ignored", exc_info=True)


def kernel_pid(km) -> int | None:
    proc = getattr(getattr(km, "provisioner", None), "process", None)
    return getattr(proc, "pid", None)


def kernel_exit_code(km) -> int | None:
    proc = getattr(getattr(km, "provisioner", None), "process", None)
    return getattr(proc, "returncode", None)


def kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")     # debugpy's frozen-modules warning
    env.setdefault("PYTHONUNBUFFERED", "1")
    home = env.get("HOME", "")
    if not (home and os.path.isdir(home) and os.access(home, os.W_OK)):
        env["IPYTHONDIR"] = env.get("IPYTHONDIR") or os.path.join(STATE_DIR, "ipython")
    return env


STATE_DIR = ""


def make_state_dir() -> str:
    """Connection files and (without a writable HOME) IPython's profile: private, per server."""
    d = tempfile.mkdtemp(prefix="dsec-code-interpreter-")
    os.environ.setdefault("JUPYTER_RUNTIME_DIR", os.path.join(d, "runtime"))
    return d


# ---------------------------------------------------------------------------------------
# The contexts of this server
# ---------------------------------------------------------------------------------------


class Contexts:
    def __init__(self, default_cwd: str):
        self.default_cwd = default_cwd
        self.lock = threading.Lock()
        self.by_id: dict[str, Context] = {}

    def _new(self, context_id: str, language: str, cwd: str) -> Context:
        if len(self.by_id) >= MAX_CONTEXTS:
            raise HTTPError(429, f"too many contexts ({MAX_CONTEXTS}); remove one first")
        ctx = Context(context_id, language, cwd)
        self.by_id[context_id] = ctx
        return ctx

    def default(self, language: str = "python") -> Context:
        language = check_language(language)
        cid = DEFAULT_CONTEXT_ID if language == "python" else language
        with self.lock:
            ctx = self.by_id.get(cid)
            if ctx is None:
                ctx = self._new(cid, language, self.default_cwd)
            return ctx

    def create(self, language: str | None, cwd: str | None) -> Context:
        language = check_language(language or "python")
        cwd = cwd or self.default_cwd
        if not os.path.isdir(cwd):
            raise HTTPError(400, f"cwd {cwd!r} is not a directory")
        with self.lock:
            return self._new(str(uuid.uuid4()), language, cwd)

    def get(self, context_id: str) -> Context:
        with self.lock:
            ctx = self.by_id.get(context_id)
        if ctx is None:
            raise HTTPError(404, f"context {context_id!r} not found")
        return ctx

    def remove(self, context_id: str) -> None:
        with self.lock:
            ctx = self.by_id.pop(context_id, None)
        if ctx is None:
            raise HTTPError(404, f"context {context_id!r} not found")
        ctx.close()

    def all(self) -> list[Context]:
        with self.lock:
            return list(self.by_id.values())

    def close_all(self) -> None:
        for ctx in self.all():
            ctx.close()
        for ctx in self.all():
            ctx.thread.join(timeout=5)


def check_language(language: str) -> str:
    """The language's canonical name, or E2B's 400 naming the languages this image has."""
    name = ALIASES.get(language, ALIASES.get(language.lower(), language.lower()))
    if name not in LANGUAGES:
        raise HTTPError(400, f"language {language!r} is not available here: this sandbox has kernels "
                             f"for {', '.join(LANGUAGES)}")
    return name


def find_languages(dirs: tuple[str, ...] = KERNEL_DIRS) -> dict[str, str]:
    """language -> kernel name from the kernelspecs installed in the image (a directory scan,
    so that the start stays free of jupyter_client's slow import). Python is ipykernel's
    python3, there with or without a kernelspec file."""
    found = {"python": "python3"}
    extra = [os.path.join(p, "kernels") for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    for d in (*extra, *dirs):
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for kernel in names:
            try:
                with open(os.path.join(d, kernel, "kernel.json")) as f:
                    language = str(json.load(f).get("language", "")).lower()
            except (OSError, ValueError, AttributeError):
                continue
            if language and language not in found:
                found[language] = kernel
    return found


# ---------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dsec-code-interpreter"
    contexts: Contexts            # set on the class by serve()
    default_timeout: float | None = None

    def log_message(self, fmt: str, *args) -> None:
        log.info("%s %s", self.address_string(), fmt % args)

    # ---- plumbing -----------------------------------------------------------------------

    def _path(self) -> list[str]:
        return [p for p in self.path.split("?", 1)[0].split("/") if p]

    def _body(self) -> dict:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raw = self._read_chunked()
        else:
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY_BYTES:
                raise HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes")
            raw = self.rfile.read(n) if n else b""
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise HTTPError(400, f"the body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return data

    def _read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            size = int(self.rfile.readline(64).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            if len(out) + size > MAX_BODY_BYTES:
                raise HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes")
            out += self.rfile.read(size)
            self.rfile.readline(8)

    def _send(self, status: int, body: object = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)

    def _send_error(self, status: int, message: str) -> None:
        data = message.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _dispatch(self, method: str) -> None:
        try:
            self._route(method, self._path())
        except HTTPError as e:
            self.close_connection = True        # the body may be left unread
            self._send_error(e.status, e.message)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a 500, logged
            log.exception("%s %s failed", method, self.path)
            self.close_connection = True
            try:
                self._send_error(500, f"{type(e).__name__}: {e}")
            except OSError:
                pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # ---- routes -------------------------------------------------------------------------

    def _route(self, method: str, parts: list[str]) -> None:
        cs = self.contexts
        if method == "GET" and parts in ([], ["health"]):
            self._send(200, {"status": "ok"})
        elif method == "POST" and parts == ["execute"]:
            self._execute(self._body())
        elif parts == ["contexts"] and method == "GET":
            self._send(200, [c.describe() for c in cs.all()])
        elif parts == ["contexts"] and method == "POST":
            body = self._body()
            ctx = cs.create(_opt_str(body, "language"), _opt_str(body, "cwd"))
            try:
                ctx.call(Context.ensure_kernel, timeout=KERNEL_READY_S + 30)
            except Exception as e:  # noqa: BLE001 - the client's 500
                _quiet(cs.remove, ctx.id)
                raise HTTPError(500, f"the {ctx.language} kernel did not start: {type(e).__name__}: {e}") from None
            self._send(201, ctx.describe())
        elif len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
            cs.remove(parts[1])
            self._send(204)
        elif len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
            ctx = cs.get(parts[1])
            try:
                ctx.call(Context.restart, timeout=KERNEL_READY_S + 30)
            except Exception as e:  # noqa: BLE001 - the client's 500
                raise HTTPError(500, f"restarting the kernel failed: {type(e).__name__}: {e}") from None
            self._send(204)
        else:
            raise HTTPError(404, f"no route {method} /{'/'.join(parts)}")

    def _execute(self, body: dict) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            raise HTTPError(400, "'code' must be a string")
        context_id, language = _opt_str(body, "context_id"), _opt_str(body, "language")
        if context_id and language:
            raise HTTPError(400, "give context_id or language, not both")
        env_vars = body.get("env_vars")
        if env_vars is not None and not (isinstance(env_vars, dict)
                                         and all(isinstance(k, str) for k in env_vars)):
            raise HTTPError(400, "'env_vars' must be an object of strings")
        timeout = body.get("timeout", self.default_timeout)
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            timeout = None
        ctx = self.contexts.get(context_id) if context_id else self.contexts.default(language or "python")
        job = Job(code, env_vars or None, timeout)
        ctx.submit(job)
        started = False
        try:
            while True:
                try:
                    ev = job.events.get(timeout=POLL_S)
                except queue.Empty:
                    if self._client_gone():
                        job.cancel.set()
                        self.close_connection = True
                        return
                    continue
                if ev[0] == "fail":
                    raise HTTPError(ev[1], ev[2])
                if ev[0] == "ready":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-ndjson")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.send_header("Cache-Control", "no-store")
                    self.end_headers()
                    started = True
                elif ev[0] == "line":
                    self._chunk(json.dumps(ev[1]).encode() + b"\n")
                elif ev[0] == "done":
                    if started:
                        self._chunk(b'{"type": "end_of_execution"}\n')
                        self.wfile.write(b"0\r\n\r\n")
                    else:
                        raise HTTPError(500, "the execution ended before it started")
                    return
        except (BrokenPipeError, ConnectionResetError):
            job.cancel.set()
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _client_gone(self) -> bool:
        """The client closed its end (EOF); anything it sent beyond the request stays unread."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


def _opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise HTTPError(400, f"{key!r} must be a string")
    return v


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global STATE_DIR
    ap = argparse.ArgumentParser(prog="dsec-code-interpreter",
                                 description="E2B code-interpreter protocol over Jupyter kernels (port 49999)")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--cwd", default=None, help="default context's working directory (default: the current one)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="longest execution in seconds when the request gives none (default: no limit)")
    ap.add_argument("--daemon", action="store_true",
                    help="serve in the background; exit 0 once the port listens")
    ap.add_argument("--log", default=None,
                    help="log file (default: stderr; with --daemon /tmp/dsec-code-interpreter.log)")
    ap.add_argument("--no-prewarm", action="store_true", help="start the default kernel on first use only")
    args = ap.parse_args(argv)

    cwd = os.path.abspath(args.cwd or os.getcwd())
    try:
        server = Server((args.host, args.port), Handler)     # bound and listening from here on
    except OSError as e:
        print(f"dsec-code-interpreter: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1

    logfile = args.log or ("/tmp/dsec-code-interpreter.log" if args.daemon else None)
    if args.daemon:
        try:                                 # before the fork, so that a failure is the exit status
            fd = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as e:
            print(f"dsec-code-interpreter: cannot open the log {logfile}: {e}", file=sys.stderr)
            return 1
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() > 0:
            os._exit(0)                      # the port listens: tell whoever started us
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
    where = {"filename": logfile} if logfile and not args.daemon else {"stream": sys.stderr}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", **where)

    STATE_DIR = make_state_dir()
    LANGUAGES.clear()
    LANGUAGES.update(find_languages())
    Handler.contexts = contexts = Contexts(cwd)
    Handler.default_timeout = args.timeout

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    log.info("listening on %s:%d (pid %d, cwd %s, languages %s)", args.host, args.port, os.getpid(), cwd,
             ", ".join(LANGUAGES))
    if not args.no_prewarm:
        ctx = contexts.default()
        threading.Thread(target=lambda: _prewarm(ctx), name="prewarm", daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.5)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        log.info("shutting down")
        contexts.close_all()
        server.server_close()
    return 0


def _prewarm(ctx: Context) -> None:
    try:
        ctx.call(Context.ensure_kernel)
    except Exception:  # retried on first use
        log.exception("starting the default kernel failed; it is retried on first use")


if __name__ == "__main__":
    sys.exit(main())
