"""SWE-ReX on dsec: a deployment + runtime pair backed by dsec container sandboxes.

SWE-ReX (and SWE-agent, which drives everything through it) moves to dsec by changing the
deployment config:

    from dsec.adapters.swerex import DsecDeploymentConfig
    deployment = DsecDeploymentConfig(image="debian-python", url="http://dsec:7620").get_deployment()
    await deployment.start()
    rt = deployment.runtime                      # an AbstractRuntime: same requests, same models
    await rt.create_session(CreateBashSessionRequest())
    obs = await rt.run_in_session(BashAction(command="cd /tmp && export X=1"))

How SWE-ReX's semantics are kept (docs/adapters.md has the table):
- A SWE-ReX bash session is a dsec session (`sb.run(..., session=...)`): cwd and env persist.
  Output is stdout and stderr merged in order (`eval ... 2>&1`), as the pty of SWE-ReX's local
  runtime gives it, without its `\\r\\n` and prompt remnants. Syntax is checked first with
  `bash -n` (BashIncorrectSyntaxError, nothing runs); `check` raise/silent/ignore as SWE-ReX.
- dsec enforces a session command's timeout by ending the whole session shell. After every
  command the session saves its state (exported env, functions, cwd) in the sandbox; when the
  shell ends (timeout, `exit`, an interrupt) the adapter starts a new one and restores that
  state, so the session lives on. A timeout raises CommandTimeoutError, as SWE-ReX's local
  runtime does, saying that the shell was restarted; the next BashInterruptAction returns what
  the command had printed (SWE-ReX returns it there too).
- BashInterruptAction while a command runs ends it (dsec closes the session: SIGKILL to its
  process tree), then restores the session. Interactive programs (`is_interactive_command`,
  `expect`) need a terminal and are refused (DsecUnsupportedError).

Runs wherever the dsec SDK runs (no server side). SWE-agent calls each method under its own
`asyncio.run`; so that connections and locks outlive those loops, the adapter does its dsec I/O
on one event loop in a daemon thread (as the SDK's blocking client does), with one SDK client per
dsec URL and key shared by every deployment and runtime of the process.
"""

from __future__ import annotations

import asyncio
import atexit
import errno
import hashlib
import io
import logging
import os
import shlex
import tarfile
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (BashIncorrectSyntaxError, CommandTimeoutError, DeploymentNotStartedError,
                               DeploymentStartupError, NonZeroExitCodeError, SessionDoesNotExistError,
                               SessionExistsError, SwerexException)
from swerex.runtime.abstract import (AbstractRuntime, Action, BashAction, BashInterruptAction, BashObservation,
                                     CloseBashSessionResponse, CloseResponse, CloseSessionRequest,
                                     CloseSessionResponse, Command, CommandResponse, CreateBashSessionRequest,
                                     CreateBashSessionResponse, CreateSessionRequest, CreateSessionResponse,
                                     IsAliveResponse, Observation, ReadFileRequest, ReadFileResponse,
                                     UploadRequest, UploadResponse, WriteFileRequest, WriteFileResponse)
from swerex.utils.log import get_logger

from dsec.sdk.client import Client, Sandbox
from dsec.types import MAX_EXEC_TIMEOUT_S, ContainerArgs, DsecError, ExecResult, NotFound, SandboxInfo, SandboxState

__all__ = ["DsecDeployment", "DsecDeploymentConfig", "DsecRuntime", "DsecRuntimeConfig", "DsecUnsupportedError"]

STATE_DIR = "/tmp/.swerex"          # in the sandbox: one state file per session (<dsec session>.sh)
NO_BASH_EXIT = 97                   # the session init exits with this when the shell is not bash
SYNTAX_MARK = "\x1eswerex-syntax"   # ends stderr when `bash -n` refused the command
MIN_STARTUP_S = 10.0                # floor for CreateBashSessionRequest.startup_timeout (see create_session)
RESTORE_TIMEOUT_S = 60.0            # restarting a session: startup files + the saved state
INTERRUPT_WAIT_S = 30.0             # BashInterruptAction: how long the interrupted command may take to end
PART_BYTES = 32 << 20               # uploads are written in parts below the files API's 64 MiB per call
HTTP_SLACK_S = 600.0                # the SDK's HTTP timeout is the longest command plus this


T = TypeVar("T")


class DsecUnsupportedError(SwerexException, NotImplementedError):
    """A SWE-ReX feature dsec sessions do not have (a terminal for interactive programs)."""


class _Home:
    """The adapter's event loop, in a daemon thread, and its SDK clients (one per URL and key).

    SWE-ReX's API is async, but its callers do not keep one loop: SWE-agent wraps every call in
    `asyncio.run`. An httpx pool (and an asyncio lock) belongs to the loop it was made on, and a
    new SDK client costs ~0.1 s (httpx builds an SSL context), so every call runs here instead;
    the hop between threads costs well under a millisecond. A forked child starts its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0
        self._clients: dict[tuple[str | None, str | None], Client] = {}

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="dsec-swerex", daemon=True).start()
                self._loop, self._pid, self._clients = loop, os.getpid(), {}
            return self._loop

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the adapter's loop and wait for it from the caller's loop; cancelling
        the caller cancels it."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._get_loop()))

    def client(self, url: str | None, api_key: str | None) -> Client:
        """The shared SDK client for this apiserver (only on the adapter's loop). It lives as long
        as the process, like the loop: its pool is what every sandbox's requests reuse."""
        key = (url, api_key)
        if key not in self._clients:
            self._clients[key] = Client(url, api_key, timeout_s=MAX_EXEC_TIMEOUT_S + HTTP_SLACK_S)
        return self._clients[key]


_HOME = _Home()
_STARTED: weakref.WeakSet[DsecDeployment] = weakref.WeakSet()   # started, not stopped yet


@atexit.register
def _stop_started() -> None:
    """At interpreter exit, remove the sandboxes of deployments nobody stopped (SWE-ReX's own
    `__del__` attempt comes too late: by then the adapter's thread is frozen). A process killed
    outright leaves them to their ttl_idle_s."""
    for d in list(_STARTED):
        try:
            asyncio.run(asyncio.wait_for(d.stop(), 30))
        except Exception:   # nothing to report to at exit; ttl_idle_s is the fallback
            pass


# ------------------------------------------------------------------------------- configs

class DsecRuntimeConfig(BaseModel):
    """Configuration for `DsecRuntime`: SWE-ReX's runtime API on an existing dsec sandbox."""

    sandbox_id: str
    """The dsec sandbox (`sb-<node>.<hex>`), e.g. `sb.id` of a sandbox made with the dsec SDK."""
    url: str | None = None
    """dsec apiserver URL. None: $DSEC_URL, else the local default (started if nothing serves)."""
    api_key: str | None = None
    """None: $DSEC_API_KEY, else the admin key of the local dsec home."""

    type: Literal["dsec"] = "dsec"
    """Discriminator for (de)serialization/CLI. Do not change."""

    model_config = ConfigDict(extra="forbid")

    def get_runtime(self) -> DsecRuntime:
        return DsecRuntime.from_config(self)


class DsecDeploymentConfig(BaseModel):
    """Configuration for running in a dsec container sandbox (one per deployment)."""

    url: str | None = None
    """dsec apiserver URL. None: $DSEC_URL, else the local default (started if nothing serves)."""
    api_key: str | None = None
    """None: $DSEC_API_KEY, else the admin key of the local dsec home."""
    image: str = "debian-python"
    """A dsec image (`dsec image ls`; `dsec image import NAME --oci DIR` brings a Docker image). Needs bash."""
    cpu_cores: float = 1.0
    """CPU limit in cores."""
    memory_mb: int = 2048
    """Memory limit, MiB."""
    ttl_idle_s: int = 1800
    """dsec removes the sandbox after this long without a request (a crashed driver leaks nothing
    for longer). Keep it above the longest pause between agent steps."""
    startup_timeout: float = 180.0
    """The time to wait for the sandbox to be ready."""
    user: str | None = "root"
    """User in the sandbox: 'root' (SWE-agent images and tools expect it; dsec's containment binds
    root too), None for dsec's non-root 'sandbox' user, or 'UID[:GID]'."""
    container_kwargs: dict[str, Any] = {}
    """More `dsec.ContainerArgs` fields: workspace, toolkits, network, disk_mb, env, labels, ..."""

    type: Literal["dsec"] = "dsec"
    """Discriminator for (de)serialization/CLI. Do not change."""

    model_config = ConfigDict(extra="forbid")

    def container_args(self, **labels: str) -> ContainerArgs:
        """The dsec ContainerArgs this config creates (raises pydantic's error naming a bad field)."""
        extra = dict(self.container_kwargs)
        return ContainerArgs(**{"image": self.image, "cpu_cores": self.cpu_cores, "memory_mb": self.memory_mb,
                                "ttl_idle_s": self.ttl_idle_s, "user": self.user, **extra,
                                "labels": {**extra.get("labels", {}), **labels}})

    def get_deployment(self) -> DsecDeployment:
        return DsecDeployment.from_config(self)


# ------------------------------------------------------------------------------- runtime

@dataclass
class _Session:
    """The adapter's view of one SWE-ReX session; the shell itself is dsec session `dsec`."""

    name: str
    dsec: str
    startup_source: list[str]
    stale: bool = False                           # shell gone or outdated: restart + restore before use
    pending_output: str = ""                      # a timed-out command's output, for the next interrupt
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)   # one command at a time
    running: asyncio.Future[None] | None = None   # set while a command runs
    interrupted: bool = False                     # a BashInterruptAction ended the running command
    restarts: int = 0

    @property
    def state_file(self) -> str:
        return f"{STATE_DIR}/{self.dsec}.sh"


def _dsec_session_name(name: str) -> str:
    """dsec session names are [A-Za-z0-9_.-]{1,64}; other SWE-ReX names map to a stable hash."""
    ok = 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "_.-") for c in name)
    if ok and name not in (".", ".."):
        return name
    return "s-" + hashlib.sha256(name.encode()).hexdigest()[:20]


def _timeout_s(timeout: float | None) -> float:
    """SWE-ReX's timeout (None: none) as dsec's (at most MAX_EXEC_TIMEOUT_S, above 0)."""
    if timeout is None:
        return float(MAX_EXEC_TIMEOUT_S)
    return min(max(float(timeout), 0.001), float(MAX_EXEC_TIMEOUT_S))


def _wrap(s: _Session, command: str) -> str:
    """What a session runs for one BashAction: check the syntax first (SWE-ReX's `bash -n`),
    then eval at the shell's top level (cd/export/functions persist) with stderr merged into
    stdout, then save the state. The command travels single-quoted in a variable, so nothing
    in it (an unterminated here-doc, a stray quote) can reach the lines after it."""
    err = f"{s.state_file[:-3]}.syntax"
    return (f"__swerex_c={shlex.quote(command)}\n"
            f'if "$BASH" -n 2>{err} <<<"$__swerex_c"; then eval "$__swerex_c" 2>&1; __swerex_save; '
            f"else cat {err} >&2; printf '{SYNTAX_MARK}\\n' >&2; unset __swerex_c; false; fi")


def _init_script(s: _Session, *, restore: bool) -> str:
    """Start (or, with restore, restart) the session's shell: require bash, define the state
    saver, source the startup files, restore the saved state (or forget an old one)."""
    st = s.state_file
    lines = [
        (f'[ -n "$BASH_VERSION" ] || {{ echo "the session shell is not bash: SWE-ReX sessions need /bin/bash '
         f'in the image" >&2; exit {NO_BASH_EXIT}; }}'),
        f"mkdir -p {STATE_DIR}",
        # exported variables, functions and cwd after each command; `return` keeps the exit code
        ("__swerex_save() { local __swerex_rc=$?; unset __swerex_c; "
         f"{{ export -p; declare -f; printf 'cd -- %q\\n' \"$PWD\"; }} >{st} 2>/dev/null; return $__swerex_rc; }}"),
    ]
    if not restore:
        # SWE-ReX's shell has a terminal, where Python flushes each line; through dsec's pipes it
        # would hold prints back until exit, after its traceback. (The saved state keeps it.)
        lines.append('export PYTHONUNBUFFERED="${PYTHONUNBUFFERED-1}"')
    quiet = " >/dev/null 2>&1" if restore else " 2>&1"
    lines += [f"source {path}{quiet}" for path in s.startup_source]   # unquoted, as SWE-ReX does
    lines.append(f"[ -f {st} ] && . {st} >/dev/null 2>&1" if restore else f"rm -f {st}")
    lines.append("__swerex_save")
    return "\n".join(lines)


def _tar_parts(source: Path) -> Iterator[bytes]:
    """`source` (a directory) as an uncompressed tar, in parts of at most PART_BYTES. Owners
    become 0:0, so the files belong to whoever unpacks them (root or the sandbox user)."""
    def anonymous(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        return ti

    with tempfile.TemporaryFile() as tmp:
        with tarfile.open(fileobj=tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for child in sorted(source.iterdir()):   # not "." itself: the target keeps its own mode
                tar.add(str(child), arcname=child.name, filter=anonymous)
        tmp.seek(0)
        while chunk := tmp.read(PART_BYTES):
            yield chunk


class DsecRuntime(AbstractRuntime):
    def __init__(self, *, sandbox: str | SandboxInfo, url: str | None = None, api_key: str | None = None,
                 logger: logging.Logger | None = None, **kwargs: Any):
        """SWE-ReX's runtime API on a dsec sandbox (made by DsecDeployment, or by the dsec SDK).

        Args:
            sandbox: the sandbox id, or its SandboxInfo (saves a lookup)
            url, api_key: the dsec apiserver (see DsecRuntimeConfig)
        """
        sandbox_id = sandbox if isinstance(sandbox, str) else sandbox.id
        self._config = DsecRuntimeConfig(sandbox_id=sandbox_id, url=url, api_key=api_key, **kwargs)
        self._info = sandbox if isinstance(sandbox, SandboxInfo) else None
        self._sb: Sandbox | None = None
        self._sb_client: Client | None = None
        self._sessions: dict[str, _Session] = {}
        self._top: set[str] | None = None      # entries of "/" in the sandbox, once an op needed them
        self.logger = logger or get_logger("rex-runtime")

    @classmethod
    def from_config(cls, config: DsecRuntimeConfig) -> DsecRuntime:
        return cls(sandbox=config.sandbox_id, url=config.url, api_key=config.api_key)

    @property
    def sandbox_id(self) -> str:
        """The dsec sandbox: `await dsec.Client(...).get(rt.sandbox_id)` reaches what SWE-ReX has
        no verb for (pack_diff, set_network, stream, ...)."""
        return self._config.sandbox_id

    async def _sandbox(self) -> Sandbox:
        """The SDK's handle on the sandbox (on the adapter's loop; a new one after a fork)."""
        client = _HOME.client(self._config.url, self._config.api_key)
        if self._sb is None or self._sb_client is not client:
            info = self._info or (await client.get(self.sandbox_id)).info
            self._sb, self._sb_client = Sandbox(client, info), client
        return self._sb

    # Every public method runs its body on the adapter's loop (_Home).

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """Checks if the sandbox is running."""
        return await _HOME.run(self._is_alive(timeout))

    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        """Creates a bash session. `startup_timeout` is at least MIN_STARTUP_S here: it also
        covers starting the shell on the node, which a creation burst can slow beyond SWE-ReX's
        1 s default (a timeout would kill the session before its first command)."""
        return await _HOME.run(self._create_session(request))

    async def run_in_session(self, action: Action) -> Observation:
        """Runs a command in a session, or interrupts it (BashInterruptAction).

        Raises:
            SessionDoesNotExistError, BashIncorrectSyntaxError (nothing ran),
            CommandTimeoutError (the session lives on: see the module doc),
            NonZeroExitCodeError (check="raise"), DsecUnsupportedError (interactive programs).
        """
        return await _HOME.run(self._run_in_session(action))

    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        """Closes a shell session (a command running in it is killed)."""
        return await _HOME.run(self._close_session(request))

    async def execute(self, command: Command) -> CommandResponse:
        """Executes a command (independent of any shell session), like `subprocess.run()`.

        Raises:
            CommandTimeoutError: If the command times out.
            NonZeroExitCodeError: If the command has a non-zero exit code and `check` is True.
        """
        return await _HOME.run(self._execute(command))

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        """Reads a file as text, like `Path.read_text()` (universal newlines; UTF-8 by default)."""
        return await _HOME.run(self._read_file(request))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Writes a string to a file (UTF-8), creating missing parent directories."""
        return await _HOME.run(self._write_file(request))

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """Uploads a local file to target_path, or a local directory's contents into target_path
        (created if missing; existing files are overwritten), as SWE-ReX's remote runtime does."""
        return await _HOME.run(self._upload(request))

    async def close(self) -> CloseResponse:
        """Closes every session (the sandbox stays; DsecDeployment.stop removes it)."""
        return await _HOME.run(self._close())

    # -- liveness -------------------------------------------------------------------------
    async def _is_alive(self, timeout: float | None) -> IsAliveResponse:
        try:
            sb = await self._sandbox()
            info = await (asyncio.wait_for(sb.refresh(), timeout) if timeout else sb.refresh())
        except Exception as e:   # like RemoteRuntime: any failure is "not alive", with the reason
            return IsAliveResponse(is_alive=False, message=f"dsec sandbox {self.sandbox_id}: {e!r}")
        if info.state != SandboxState.running:
            why = f": {info.error}" if info.error else ""
            return IsAliveResponse(is_alive=False, message=f"dsec sandbox {info.id} is {info.state.value}{why}")
        return IsAliveResponse(is_alive=True)

    # -- sessions -------------------------------------------------------------------------
    async def _create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        if not isinstance(request, CreateBashSessionRequest):
            raise ValueError(f"unknown session type: {request!r}")
        s = _Session(request.session, _dsec_session_name(request.session), list(request.startup_source))
        self._sessions[s.name] = s
        try:
            sb = await self._sandbox()
            async with s.lock:
                await sb.close_session(s.dsec)   # a shell an earlier runtime left on this sandbox
                r = await self._start_shell(sb, s, restore=False, timeout=max(request.startup_timeout, MIN_STARTUP_S))
        except BaseException:
            del self._sessions[s.name]
            raise
        return CreateBashSessionResponse(output=r.stdout + r.stderr)

    async def _start_shell(self, sb: Sandbox, s: _Session, *, restore: bool, timeout: float) -> ExecResult:
        """Run the init script in the session's (new) shell. Caller holds the session's lock."""
        r = await sb.run(_init_script(s, restore=restore), session=s.dsec, timeout_s=timeout)
        if r.timed_out:
            raise CommandTimeoutError(f"timeout after {timeout} seconds while starting session {s.name!r} "
                                      f"(startup_source: {s.startup_source})")
        if r.session_ended:
            if r.exit_code == NO_BASH_EXIT:
                raise SwerexException(r.stderr.strip())
            raise SwerexException(f"the shell of session {s.name!r} exited while starting (exit code "
                                  f"{r.exit_code}): {(r.stdout + r.stderr)[-2000:]!r}")
        s.stale = False
        return r

    async def _restore(self, sb: Sandbox, s: _Session, *, kill: bool) -> None:
        """A new shell for the session with the state saved after its last finished command.
        `kill`: the old shell may still live (an outdated one): close it first."""
        if kill:
            await sb.close_session(s.dsec)
        await self._start_shell(sb, s, restore=True, timeout=RESTORE_TIMEOUT_S)
        s.restarts += 1
        self.logger.debug("session %r: new shell #%d with the saved state", s.name, s.restarts)

    def _session(self, name: str) -> _Session:
        s = self._sessions.get(name)
        if s is None:
            raise SessionDoesNotExistError(f"session {name!r} does not exist")
        return s

    async def _run_in_session(self, action: Action) -> Observation:
        s = self._session(action.session)
        if isinstance(action, BashInterruptAction):
            return await self._interrupt(s)
        if action.is_interactive_command or action.is_interactive_quit or action.expect:
            raise DsecUnsupportedError(
                "interactive programs (is_interactive_command, is_interactive_quit, expect) need a terminal; "
                "dsec session commands run with stdin from /dev/null: run the program non-interactively "
                "(gdb -batch -ex ..., python -c ..., input piped in)")
        sb = await self._sandbox()
        async with s.lock:
            if s.stale:
                await self._restore(sb, s, kill=True)
            s.interrupted = False
            s.running = running = asyncio.get_running_loop().create_future()
            try:
                r = await sb.run(_wrap(s, action.command), session=s.dsec, timeout_s=_timeout_s(action.timeout))
            finally:
                s.running = None
                running.set_result(None)
            return await self._observe(sb, s, action, r)

    async def _observe(self, sb: Sandbox, s: _Session, action: BashAction, r: ExecResult) -> BashObservation:
        """The dsec result as SWE-ReX's observation or exception. Caller holds the lock."""
        output = r.stdout + r.stderr
        if r.timed_out and not s.interrupted:
            s.pending_output, s.stale = output, True
            try:
                await self._restore(sb, s, kill=False)
                note = ("dsec ended the session's shell at the timeout; a new one was started with the "
                        "working directory, exported environment and functions of the last finished command")
            except Exception as e:
                note = (f"dsec ended the session's shell at the timeout; starting a new one failed ({e!r}), "
                        "the next command tries again")
            exc = CommandTimeoutError(f"timeout after {action.timeout} seconds while running command "
                                      f"{action.command!r} ({note})")
            # as RemoteRuntime sets it on the exceptions it re-raises
            exc.extra_info = {"output": output, "session_restarted": not s.stale}  # type: ignore[attr-defined]
            raise exc
        if r.stderr.endswith(SYNTAX_MARK + "\n") and not r.session_ended:
            stderr = r.stderr[: -len(SYNTAX_MARK) - 1]
            raise BashIncorrectSyntaxError(
                f"Error (exit code 2) while checking bash command \n{action.command!r}\n"
                f"---- Stderr ----\n{stderr}\n---- Stdout ----\n{r.stdout}",
                extra_info={"bash_stdout": r.stdout, "bash_stderr": stderr})
        exit_code = r.exit_code
        failure = []
        if r.session_ended:
            s.stale = True
            if s.interrupted:   # the BashInterruptAction that closed the session restores it
                exit_code = 128 + (r.signal or 9)
                failure.append("interrupted: dsec killed the session's processes (SIGKILL); the session "
                               "continues in a new shell with the state of the last finished command")
            else:
                why = f"the session's shell exited (exit code {r.exit_code}); "
                try:
                    await self._restore(sb, s, kill=False)
                    failure.append(why + "a new one was started with the state of the last finished command")
                except Exception as e:
                    failure.append(why + f"starting a new one failed ({e!r}), the next command tries again")
        if r.truncated:
            failure.append(f"output truncated: the command wrote {r.stdout_bytes} bytes, beyond the "
                           "sandbox's output_cap_bytes")
        obs = BashObservation(output=output, exit_code=None if action.check == "ignore" else exit_code,
                              failure_reason="; ".join(failure))
        if action.check == "raise" and obs.exit_code != 0:
            msg = f"Command {action.command!r} failed with exit code {obs.exit_code}. Here is the output:\n{output!r}"
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return obs

    async def _interrupt(self, s: _Session) -> BashObservation:
        """SWE-ReX's Ctrl-C. A running command is ended (dsec closes its session: SIGKILL to the
        tree) and the session restarted with its saved state; after a timeout (the command is
        already gone) this returns what the timed-out command printed, as SWE-ReX does."""
        sb = await self._sandbox()
        running = s.running
        if running is not None and not running.done():
            s.interrupted = True
            deadline = time.monotonic() + INTERRUPT_WAIT_S
            while not running.done():
                # again each second: a close that reached dsec before the command did ends nothing
                await sb.close_session(s.dsec)
                s.stale = True
                if time.monotonic() > deadline:
                    raise SwerexException(f"Failed to interrupt session {s.name!r}: the command did not end "
                                          f"within {INTERRUPT_WAIT_S}s of closing its dsec session")
                await asyncio.wait([running], timeout=1.0)
            async with s.lock:
                if s.stale:
                    await self._restore(sb, s, kill=False)
            return BashObservation(output="", exit_code=0)
        output, s.pending_output = s.pending_output.strip(), ""
        return BashObservation(output=output, exit_code=0)

    async def _close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        s = self._session(request.session)
        await (await self._sandbox()).close_session(s.dsec)
        del self._sessions[s.name]
        return CloseBashSessionResponse()

    # -- one-off commands -----------------------------------------------------------------
    async def _execute(self, command: Command) -> CommandResponse:
        if isinstance(command.command, list):
            cmd = shlex.join(command.command)
        elif command.shell:
            cmd = command.command
        else:   # subprocess.run("x y") without a shell runs the program named "x y"
            cmd = shlex.quote(command.command)
        cwd = command.cwd
        if cwd is not None and not cwd.startswith("/"):   # dsec takes absolute ones; relative: to the workdir
            cmd, cwd = f"cd -- {shlex.quote(cwd)} || exit 1\n{cmd}", None
        if command.merge_output_streams:
            cmd = f"exec 2>&1\n{cmd}"
        sb = await self._sandbox()
        r = await sb.run(cmd, timeout_s=_timeout_s(command.timeout), cwd=cwd, env=command.env or None)
        if r.timed_out:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        code = r.exit_code if r.exit_code is not None else -(r.signal or 0)   # subprocess: -signal
        resp = CommandResponse(stdout=r.stdout, stderr=r.stderr, exit_code=code)
        if command.check and code != 0:
            msg = (f"Command {command.command!r} failed with exit code {code}. "
                   f"Stdout:\n{resp.stdout!r}\nStderr:\n{resp.stderr!r}")
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return resp

    # -- files ----------------------------------------------------------------------------
    async def _read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        sb = await self._sandbox()
        try:
            data = await sb.files.read(request.path)
        except NotFound as e:
            raise FileNotFoundError(errno.ENOENT, e.message, request.path) from e
        text = io.TextIOWrapper(io.BytesIO(data), encoding=request.encoding or "utf-8", errors=request.errors)
        return ReadFileResponse(content=text.read())

    async def _write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        sb = await self._sandbox()
        new_top = await self._new_top_level(sb, request.path)
        await sb.files.write(request.path, request.content.encode(), mkdirs=True)
        self._appeared(new_top)
        return WriteFileResponse()

    async def _upload(self, request: UploadRequest) -> UploadResponse:
        source = Path(request.source_path).resolve()
        target = request.target_path
        if not (source.is_dir() or source.is_file()):
            raise ValueError(f"Source path {source} is not a file or directory")
        sb = await self._sandbox()
        new_top = await self._new_top_level(sb, target)
        mode = source.stat().st_mode & 0o7777
        if source.is_file() and source.stat().st_size <= PART_BYTES:
            await sb.files.write(target, source.read_bytes(), mode=mode, mkdirs=True)
        else:
            # parts go into the target's directory (the files API creates it, also at the top
            # level, where commands may not: docs/decisions.md D11), then one command joins them
            where = target if source.is_dir() else str(PurePosixPath(target).parent)
            stem = f"{where.rstrip('/')}/.swerex-upload-{uuid.uuid4().hex[:12]}"
            parts: list[str] = []
            chunks = _tar_parts(source) if source.is_dir() else _file_parts(source)
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                parts.append(f"{stem}.{len(parts)}")
                await sb.files.write(parts[-1], chunk, mode=0o600, mkdirs=True)
            q, t = " ".join(shlex.quote(p) for p in parts), shlex.quote(target)
            join = f"cat {q} | tar -xf - -C {t}" if source.is_dir() else f"cat {q} > {t} && chmod {mode:o} {t}"
            r = await sb.run(f"{join}; rc=$?; rm -f {q}; exit $rc", timeout_s=3600)
            if r.exit_code != 0:
                raise SwerexException(f"unpacking the upload into {target} failed (exit code {r.exit_code}): "
                                      f"{r.stderr[-2000:]}")
        self._appeared(new_top)
        return UploadResponse()

    async def _new_top_level(self, sb: Sandbox, path: str) -> str | None:
        """The entry of "/" that writing `path` creates, if it does not exist yet."""
        parts = PurePosixPath(path).parts
        if len(parts) < 2 or parts[0] != "/":
            return None
        if self._top is not None and parts[1] in self._top:
            return None
        self._top = {e.name for e in await sb.files.list("/")}
        return None if parts[1] in self._top else parts[1]

    def _appeared(self, top: str | None) -> None:
        """A new entry of "/" was made by the files API. dsec's Landlock rules let a command write
        there only if it started afterwards (D11): the session shells are outdated, and each is
        restarted with its saved state before its next command."""
        if top is None:
            return
        assert self._top is not None
        self._top.add(top)
        for s in self._sessions.values():
            s.stale = True
        if self._sessions:
            self.logger.debug("new /%s: sessions restart before their next command", top)

    # -- lifetime -------------------------------------------------------------------------
    async def _close(self) -> CloseResponse:
        sb = await self._sandbox()
        for s in list(self._sessions.values()):
            try:
                await sb.close_session(s.dsec)
            except DsecError as e:
                self.logger.warning("closing session %r: %s", s.name, e)
        self._sessions.clear()
        return CloseResponse()


def _file_parts(source: Path) -> Iterator[bytes]:
    with open(source, "rb") as f:
        while chunk := f.read(PART_BYTES):
            yield chunk


# ---------------------------------------------------------------------------- deployment

class DsecDeployment(AbstractDeployment):
    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any):
        """A dsec container sandbox per deployment: `start()` creates it, `stop()` removes it.

        Args:
            **kwargs: Keyword arguments (see `DsecDeploymentConfig` for details).
        """
        self._config = DsecDeploymentConfig(**kwargs)
        self._runtime: DsecRuntime | None = None
        self._sandbox: SandboxInfo | None = None
        self._hooks = CombinedDeploymentHook()
        self.logger = logger or get_logger("rex-deploy")

    @classmethod
    def from_config(cls, config: DsecDeploymentConfig) -> DsecDeployment:
        return cls(**config.model_dump())

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox_id(self) -> str:
        """The dsec sandbox id. Raises DeploymentNotStartedError."""
        if self._sandbox is None:
            raise DeploymentNotStartedError()
        return self._sandbox.id

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """Checks if the sandbox is running. The return value can be tested with bool().

        Raises:
            DeploymentNotStartedError: If the deployment was not started.
        """
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Creates the sandbox (ready when this returns: dsec waits for its agent).

        Raises:
            DeploymentStartupError: dsec refused (the message has dsec's fix) or startup_timeout passed.
        """
        if self._runtime is not None:
            self.logger.warning("Deployment is already started. Ignoring duplicate start() call.")
            return
        self._hooks.on_custom_step("Starting dsec sandbox")
        t0 = time.monotonic()
        self._sandbox = await _HOME.run(self._create())
        self._runtime = DsecRuntime(sandbox=self._sandbox, url=self._config.url, api_key=self._config.api_key,
                                    logger=self.logger)
        _STARTED.add(self)
        self.logger.info("dsec sandbox %s (%s) ready in %.2fs", self._sandbox.id, self._config.image,
                         time.monotonic() - t0)

    async def _create(self) -> SandboxInfo:
        tag = uuid.uuid4().hex[:16]
        args = self._config.container_args(**{"swerex-deployment": tag})
        client = _HOME.client(self._config.url, self._config.api_key)
        try:
            sb = await asyncio.wait_for(client.create_container(args), self._config.startup_timeout)
        except TimeoutError:
            await self._remove_tagged(client, tag)
            raise DeploymentStartupError(f"dsec sandbox from image {args.image!r} was not ready within "
                                         f"startup_timeout={self._config.startup_timeout}s") from None
        except DsecError as e:
            fix = f" (fix: {e.fix})" if e.fix else ""
            raise DeploymentStartupError(f"dsec could not create a sandbox from image {args.image!r}: "
                                         f"{e.message}{fix}") from e
        return sb.info

    async def _remove_tagged(self, client: Client, tag: str) -> None:
        """After an abandoned creation: remove the sandbox if it came up after all."""
        try:
            for info in await client.list():
                if info.labels.get("swerex-deployment") == tag:
                    await Sandbox(client, info).stop()
        except DsecError as e:
            self.logger.warning("removing the abandoned sandbox (label swerex-deployment=%s): %s; "
                                "its ttl_idle_s removes it", tag, e)

    async def stop(self) -> None:
        """Closes the runtime and removes the sandbox."""
        runtime, info = self._runtime, self._sandbox
        self._runtime = self._sandbox = None
        _STARTED.discard(self)
        if runtime is not None:
            try:
                await runtime.close()
            except Exception as e:
                self.logger.warning("closing the runtime of %s: %r", info.id if info else "?", e)
        if info is not None:
            await _HOME.run(self._remove(info))

    async def _remove(self, info: SandboxInfo) -> None:
        try:
            await Sandbox(_HOME.client(self._config.url, self._config.api_key), info).stop()
        except NotFound:
            pass   # already gone (ttl_idle_s, or removed by someone else)

    @property
    def runtime(self) -> DsecRuntime:
        """Returns the runtime if running.

        Raises:
            DeploymentNotStartedError: If the deployment was not started.
        """
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime
