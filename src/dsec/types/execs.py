"""Exec, sessions, files."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, Field, field_validator, model_validator)
from dsec.types.sandboxes import _check_user, _Strict, Env, IdempotencyKey, MAX_TTL_S, USER_RE


MAX_EXEC_TIMEOUT_S = 24 * 3600


class PtySize(_Strict):
    """A terminal's size in character cells."""
    cols: Annotated[int, Field(ge=1, le=4096)] = 80
    rows: Annotated[int, Field(ge=1, le=4096)] = 24


class ExecRequest(_Strict):
    cmd: Annotated[str, Field(min_length=1, max_length=1024 * 1024, description="run by the image's shell (-c)")]
    session: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                                         description="persistent shell session name; cwd and env survive between calls")] = None
    cwd: Annotated[str | None, Field(pattern=r"^/[^\x00]{0,4095}$")] = None
    env: Env = Field(default_factory=dict)
    timeout_s: Annotated[float, Field(gt=0, le=MAX_EXEC_TIMEOUT_S)] = 300.0
    stdin: Annotated[str | None, Field(max_length=16 * 1024 * 1024, description="text fed to stdin, then closed")] = None
    output_cap_bytes: Annotated[int | None, Field(ge=1024, le=64 * 1024 * 1024)] = None
    user: Annotated[str | None, Field(pattern=USER_RE, description="None: the sandbox's user"),
                    AfterValidator(_check_user)] = None
    keep_stdin: bool = Field(False, description="stdin stays open after `stdin` for later writes "
                                                "(POST .../execs/{id}/stdin); closed by a write with close=true")
    tag: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
                                     description="a free label shown in list_execs")] = None
    idempotency_key: IdempotencyKey = None
    pty: PtySize | None = Field(None, description="run on a terminal of this size: output comes as `pty` events "
                                                   "(bytes, base64), stdin is typed into it, resize changes its size")

    @model_validator(mode="after")
    def _pty_alone(self) -> "ExecRequest":
        if self.pty is not None and self.session is not None:
            raise ValueError("pty cannot be combined with session: a terminal runs its own shell")
        return self

    @field_validator("cmd")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\0" in v:
            raise ValueError("cmd must not contain a NUL byte")
        return v


class ExecResult(BaseModel):
    exec_id: str
    exit_code: int | None = Field(description="None when killed by a signal")
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    truncated: bool = Field(False, description="output exceeded output_cap_bytes; the rest was dropped")
    stdout_bytes: int = Field(0, description="bytes the command wrote to stdout, including dropped ones")
    stderr_bytes: int = 0
    session_ended: bool = Field(False, description="the session shell exited (exit, timeout); next call starts a new one")
    duration_s: float = 0.0
    output_budget_exhausted: bool = Field(False, description="the sandbox's output_total_bytes is spent: this "
                                                             "command's output was cut short or dropped")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class ExecInfo(BaseModel):
    """A command started in a sandbox (list_execs, start_exec)."""

    exec_id: str
    cmd: str = Field("", description="empty for a command started before the edge restarted")
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    tag: str | None = None
    session: str | None = None
    running: bool = True
    detached: bool = Field(False, description="started with start_exec: its output is kept for followers")
    stdin_open: bool = False
    pty: bool = Field(False, description="runs on a terminal (resize applies)")
    started_at: datetime | None = None
    exit_code: int | None = None
    signal: int | None = None


class ExecList(BaseModel):
    execs: list[ExecInfo]


class SignalRequest(_Strict):
    signal: Annotated[int, Field(ge=1, le=64, description="signal number, e.g. 15 (TERM), 9 (KILL), 2 (INT)")]


class TimeoutRequest(_Strict):
    timeout_s: Annotated[float, Field(gt=0, le=MAX_TTL_S,
                                      description="the sandbox ends this long from now (absolute lifetime)")]


class ExecEvent(BaseModel):
    """One line of a streamed exec (NDJSON). data is UTF-8 text with invalid bytes replaced; of a
    `pty` event (an exec on a terminal), the terminal's output bytes in base64."""

    type: Literal["start", "stdout", "stderr", "pty", "exit"]
    data: str = ""
    exec_id: str | None = None
    result: ExecResult | None = None


class FileWrite(_Strict):
    path: Annotated[str, Field(min_length=1, max_length=4096)]
    data_b64: str
    mode: Annotated[int, Field(ge=0, le=0o7777)] = 0o644
    mkdirs: bool = True


class FileEntry(BaseModel):
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class FsEvent(BaseModel):
    """One item of a directory watch (Edge.watch_dir): `start` once the watch is in place, then
    one per change below the directory (`overflow`: the kernel dropped events; re-list)."""
    type: Literal["start", "create", "write", "remove", "rename", "chmod", "overflow"]
    name: str = Field("", description="path relative to the watched directory")
    is_dir: bool = False


class FileList(BaseModel):
    path: str
    entries: list[FileEntry]


class ResizeRequest(_Strict):
    cols: Annotated[int, Field(ge=1, le=4096)]
    rows: Annotated[int, Field(ge=1, le=4096)]
