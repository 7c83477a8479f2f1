"""Shared wire and domain types.

Every layer (sdk, apiserver, edge, backends, images) imports this module; it imports
nothing of theirs. The HTTP API *is* these models: FastAPI derives the OpenAPI schema from
them and the SDK sends and parses them.
"""

from __future__ import annotations

import re
import secrets
from datetime import datetime
from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# ---------------------------------------------------------------------------------------
# Errors: every failure a user can cause names the field and the fix.
# ---------------------------------------------------------------------------------------


class DsecError(Exception):
    """A failure with a stable code, the offending field (if any) and how to fix it."""

    status: int = 400
    code: str = "bad_request"

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.fix = fix

    def to_body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "field": self.field,
                          "fix": self.fix}}


class InvalidArgument(DsecError):
    status, code = 422, "invalid_argument"


class NotFound(DsecError):
    status, code = 404, "not_found"


class Unauthorized(DsecError):
    status, code = 401, "unauthorized"


class Forbidden(DsecError):
    status, code = 403, "forbidden"


class Conflict(DsecError):
    """The target exists but is in a state that does not allow the operation."""

    status, code = 409, "conflict"


class CapacityExceeded(DsecError):
    """Admission refused: the node (or quota) is full. Callers may place elsewhere."""

    status, code = 429, "capacity_exceeded"


class SandboxFailed(DsecError):
    status, code = 500, "sandbox_failed"


class Unavailable(DsecError):
    status, code = 503, "unavailable"


ERRORS_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls for cls in (DsecError, InvalidArgument, NotFound, Unauthorized, Forbidden,
                              Conflict, CapacityExceeded, SandboxFailed, Unavailable)
}


# ---------------------------------------------------------------------------------------
# Identifiers: a sandbox id encodes the node that owns it, so any apiserver can forward.
# ---------------------------------------------------------------------------------------

NODE_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")
SANDBOX_ID_RE = re.compile(r"^sb-(?P<node>[a-z0-9][a-z0-9-]{0,30})\.(?P<rand>[0-9a-f]{12})$")


def make_sandbox_id(node_id: str) -> str:
    if not NODE_ID_RE.match(node_id):
        raise InvalidArgument(f"bad node id {node_id!r}", field="node_id",
                              fix="use lowercase letters, digits and '-', at most 31 chars")
    return f"sb-{node_id}.{secrets.token_hex(6)}"


def node_of(sandbox_id: str) -> str:
    m = SANDBOX_ID_RE.match(sandbox_id)
    if not m:
        raise NotFound(f"no sandbox {sandbox_id!r}: not a sandbox id", field="sandbox_id",
                       fix="use an id returned by create, e.g. 'sb-node0.0123456789ab'")
    return m.group("node")


# ---------------------------------------------------------------------------------------
# Sandbox arguments: one type per backend, no fake uniformity.
# ---------------------------------------------------------------------------------------

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._@:+-]{0,127}$"
MAX_TTL_S = 7 * 24 * 3600
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_env(env: dict[str, str]) -> dict[str, str]:
    for k, v in env.items():
        if not ENV_KEY_RE.match(k):
            raise ValueError(f"environment variable name {k!r} is not valid: use [A-Za-z_][A-Za-z0-9_]*")
        if "\0" in v or "\0" in k:
            raise ValueError(f"environment variable {k!r} contains a NUL byte")
    return env


class ContainerArgs(_Strict):
    """A crun container over overlayfs on read-only EROFS layers."""

    backend: Literal["container"] = "container"
    image: Annotated[str, Field(pattern=NAME_RE, description="image name or sha256 digest")]
    cpu_cores: Annotated[float, Field(gt=0, le=64, description="CPU limit in cores (CFS quota)")] = 1.0
    memory_mb: Annotated[int, Field(ge=16, le=256 * 1024, description="memory limit, MiB")] = 512
    pids_limit: Annotated[int, Field(ge=8, le=65536)] = 1024
    ttl_idle_s: Annotated[int, Field(gt=0, le=MAX_TTL_S, description="reap after this long without a request")] = 600
    user: Annotated[str | None, Field(description="None: non-root 'sandbox' (uid 1000); 'root'; or 'UID[:GID]'",
                                      pattern=r"^(root|sandbox|[0-9]{1,9}(:[0-9]{1,9})?)$")] = None
    workdir: Annotated[str, Field(pattern=r"^/[^\x00]{0,255}$")] = "/work"
    env: dict[str, str] = Field(default_factory=dict)
    output_cap_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024,
                                           description="per stream per command; beyond it output is dropped and reported")] = 1024 * 1024
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _valid_env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)


# Union of all backend argument types (discriminated on `backend`); grows as backends land.
SandboxArgs = ContainerArgs


class SandboxState(str, Enum):
    creating = "creating"
    running = "running"
    stopping = "stopping"
    stopped = "stopped"
    failed = "failed"


class SandboxInfo(BaseModel):
    id: str
    node: str
    project: str
    backend: str
    state: SandboxState
    image: str
    image_digest: str | None = None
    cpu_cores: float
    memory_mb: int
    ttl_idle_s: int
    created_at: datetime
    last_active_at: datetime
    error: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]


# ---------------------------------------------------------------------------------------
# Exec, sessions, files.
# ---------------------------------------------------------------------------------------

MAX_EXEC_TIMEOUT_S = 24 * 3600


class ExecRequest(_Strict):
    cmd: Annotated[str, Field(min_length=1, max_length=1024 * 1024, description="run by the image's shell (-c)")]
    session: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                                         description="persistent shell session name; cwd and env survive between calls")] = None
    cwd: Annotated[str | None, Field(pattern=r"^/[^\x00]{0,4095}$")] = None
    env: dict[str, str] = Field(default_factory=dict)
    timeout_s: Annotated[float, Field(gt=0, le=MAX_EXEC_TIMEOUT_S)] = 300.0
    stdin: Annotated[str | None, Field(max_length=16 * 1024 * 1024, description="text fed to stdin, then closed")] = None
    output_cap_bytes: Annotated[int | None, Field(ge=1024, le=64 * 1024 * 1024)] = None
    user: Annotated[str | None, Field(pattern=r"^(root|sandbox|[0-9]{1,9}(:[0-9]{1,9})?)$")] = None

    @field_validator("env")
    @classmethod
    def _valid_env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

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

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class ExecEvent(BaseModel):
    """One line of a streamed exec (NDJSON). data is UTF-8 text with invalid bytes replaced."""

    type: Literal["start", "stdout", "stderr", "exit"]
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


class FileList(BaseModel):
    path: str
    entries: list[FileEntry]


# ---------------------------------------------------------------------------------------
# Nodes (watcher/placement view of an edge).
# ---------------------------------------------------------------------------------------


class NodeCapacity(BaseModel):
    cpu_cores: float
    memory_mb: int
    max_sandboxes: int


class NodeStatus(BaseModel):
    node_id: str
    healthy: bool
    backends: list[str]
    capacity: NodeCapacity
    committed_cpu_cores: float = 0.0
    committed_memory_mb: int = 0
    sandboxes: int = 0
    reason: str | None = None

    @property
    def load(self) -> float:
        """Fraction of the tightest resource already committed."""
        c = self.capacity
        return max(self.committed_memory_mb / max(c.memory_mb, 1),
                   self.committed_cpu_cores / max(c.cpu_cores, 1e-9),
                   self.sandboxes / max(c.max_sandboxes, 1))


# ---------------------------------------------------------------------------------------
# Images (layers are the unit; an image is an ordered list of layers, base first).
# ---------------------------------------------------------------------------------------


class LayerInfo(BaseModel):
    digest: str = Field(description="sha256:<hex> of the EROFS file")
    size_bytes: int
    created_at: datetime
    source: str = Field(description="how it was built, e.g. 'dir:/path', 'tar:/x.tgz', 'debootstrap:bookworm'")


class ImageInfo(BaseModel):
    name: str
    digest: str = Field(description="sha256 over the ordered layer digests")
    layers: list[LayerInfo]
    size_bytes: int
    created_at: datetime


class ImageList(BaseModel):
    images: list[ImageInfo]
