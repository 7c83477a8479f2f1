"""FnCall: short stateless code run in a warm pool container (dsec.fncall)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal

from pydantic import (BaseModel, Field, field_validator)
from dsec.types.sandboxes import _Strict, Env, NAME_RE


FNCALL_MAX_TIMEOUT_S = 3600.0     # SandboxFusion sets none; long builds and test suites need more than minutes
FNCALL_MAX_BYTES = 16 * 1024 * 1024
FNCALL_DEFAULT_IMAGE = "fncall-python"


def _check_rel_path(path: str) -> str:
    parts = path.split("/")
    if (not path or len(path) > 1024 or path.startswith("/") or "\0" in path
            or any(p in ("", ".", "..") for p in parts)):
        raise ValueError(f"file path {path!r} must be relative to the work dir, without '..', "
                         "'.', empty parts or NUL, at most 1024 chars")
    return path


class FnCallRequest(_Strict):
    """One call: code (plus stdin and files) run under its own limits in a fresh work dir."""

    backend: Literal["fncall"] = "fncall"
    code: Annotated[str, Field(max_length=FNCALL_MAX_BYTES, description="source code of the program")]
    language: Annotated[str, Field(pattern=r"^[A-Za-z0-9_+#.-]{1,32}$",
                                   description="python, bash, c, cpp, perl, ... (the image decides which exist)")] = "python"
    stdin: Annotated[str | None, Field(max_length=FNCALL_MAX_BYTES)] = None
    files: dict[str, str] = Field(default_factory=dict, description="extra text files: relative path -> content")
    files_b64: dict[str, str] = Field(default_factory=dict, description="extra binary files: relative path -> base64")
    fetch_files: Annotated[list[str], Field(max_length=64, description="files to return after the run (base64)")] = []
    args: Annotated[list[str], Field(max_length=256, description="command-line arguments of the program")] = []
    env: Env = Field(default_factory=dict)
    timeout_s: Annotated[float, Field(gt=0, le=FNCALL_MAX_TIMEOUT_S, description="wall-clock limit of the run step")] = 10.0
    compile_timeout_s: Annotated[float, Field(gt=0, le=FNCALL_MAX_TIMEOUT_S)] = 10.0
    memory_mb: Annotated[int, Field(ge=16, le=4096, description="address space the program may add (RLIMIT_AS)")] = 512
    max_processes: Annotated[int, Field(ge=1, le=1024, description="processes and threads (RLIMIT_NPROC)")] = 64
    max_file_mb: Annotated[int, Field(ge=1, le=1024, description="largest file the program may write")] = 64
    output_cap_bytes: Annotated[int, Field(ge=1024, le=FNCALL_MAX_BYTES,
                                           description="per stream; beyond it the program is killed (status output-limit)")] = 1024 * 1024
    image: Annotated[str, Field(pattern=NAME_RE, description="pool image; needs python3")] = FNCALL_DEFAULT_IMAGE

    @field_validator("files", "files_b64")
    @classmethod
    def _valid_files(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 256:
            raise ValueError("at most 256 files")
        if sum(len(x) for x in v.values()) > FNCALL_MAX_BYTES:
            raise ValueError(f"files hold more than {FNCALL_MAX_BYTES} bytes together")
        for k in v:
            _check_rel_path(k)
        return v

    @field_validator("files_b64")
    @classmethod
    def _valid_b64(cls, v: dict[str, str]) -> dict[str, str]:
        import base64
        import binascii
        for k, data in v.items():
            try:
                base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"files_b64[{k!r}] is not valid base64") from None
        return v

    @field_validator("fetch_files")
    @classmethod
    def _valid_fetch(cls, v: list[str]) -> list[str]:
        for k in v:
            _check_rel_path(k)
        return v

    @field_validator("args")
    @classmethod
    def _valid_args(cls, v: list[str]) -> list[str]:
        if any("\0" in a for a in v):
            raise ValueError("arguments must not contain NUL bytes")
        return v


class FnCallStatus(str, Enum):
    ok = "ok"
    runtime_error = "runtime-error"       # non-zero exit or killed by a signal
    compile_error = "compile-error"       # the compile step failed (Python: SyntaxError)
    timeout = "timeout"                   # wall-clock (or CPU) limit of a step
    memory = "memory"                     # memory limit
    output_limit = "output-limit"         # stdout or stderr beyond output_cap_bytes
    sandbox_error = "sandbox-error"       # the platform could not run the call; see `error`


class FnCallStep(BaseModel):
    """One step (compile or run) of a call."""

    exit_code: int | None = Field(description="None when killed by a signal")
    signal: int | None = None
    timed_out: bool = False
    output_limited: bool = False
    cached: bool = Field(False, description="compile step skipped: this container compiled the same code before")
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int = Field(0, description="bytes written, including those beyond the cap")
    stderr_bytes: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_rss_mb: float = 0.0


class FnCallResult(BaseModel):
    status: FnCallStatus
    exit_code: int | None = Field(None, description="of the last step that ran")
    signal: int | None = None
    stdout: str = ""
    stderr: str = Field("", description="of the last step that ran (the compiler's on compile-error)")
    wall_s: float = Field(0.0, description="run step wall time")
    cpu_s: float = Field(0.0, description="run step CPU time (user + system)")
    compile: FnCallStep | None = None
    run: FnCallStep | None = None
    files: dict[str, str] = Field(default_factory=dict, description="fetch_files found: path -> base64")
    language: str = ""
    error: str | None = None
    queue_s: float = Field(0.0, description="waiting for a warm container")
    total_s: float = Field(0.0, description="end to end on the node, queueing included")
    executor: str | None = Field(None, description="id of the pool container that ran it")

    @property
    def ok(self) -> bool:
        return self.status == FnCallStatus.ok


class FnCallBatch(_Strict):
    calls: Annotated[list[FnCallRequest], Field(min_length=1, max_length=1024)]


class FnCallBatchItem(BaseModel):
    """One line of the NDJSON answer to a batch, in completion order."""

    index: int
    result: FnCallResult
