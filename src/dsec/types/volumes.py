"""Volumes: named, persistent, project-owned directories mounted into sandboxes (D61)."""

from __future__ import annotations

import posixpath
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

VOLUME_NAME_RE = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
MAX_VOLUMES_PER_SANDBOX = 8
# where a volume may not go: the runtime's own mounts (and what they hide), the agent, the DNS file
RESERVED_PATHS = ("/proc", "/sys", "/dev", "/.dsec", "/etc/resolv.conf")

VolumeName = Annotated[str, Field(pattern=VOLUME_NAME_RE, description="the volume's name in its project")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VolumeMount(_Strict):
    """A volume of the sandbox's own project, mounted at `path` (made if missing)."""

    name: VolumeName
    path: Annotated[str, Field(min_length=2, max_length=255, description="absolute path in the sandbox")]
    read_only: bool = Field(False, description="writes under path fail with EROFS")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/") or "\0" in v or any(p in ("..", ".") for p in v.split("/")):
            raise ValueError(f"volume path {v!r} must be absolute, without '.' or '..' parts")
        v = posixpath.normpath(v)
        if v == "/" or any(v == r or v.startswith(r + "/") for r in RESERVED_PATHS):
            raise ValueError(f"volume path {v!r} is the runtime's own: mount volumes elsewhere "
                             f"(not / or under {', '.join(RESERVED_PATHS)})")
        return v


def check_mounts(mounts: list[VolumeMount]) -> list[VolumeMount]:
    """At most MAX_VOLUMES_PER_SANDBOX, each path once and none inside another."""
    if len(mounts) > MAX_VOLUMES_PER_SANDBOX:
        raise ValueError(f"{len(mounts)} volumes: at most {MAX_VOLUMES_PER_SANDBOX} per sandbox")
    paths = sorted(m.path for m in mounts)
    for a, b in zip(paths, paths[1:]):
        if b == a or b.startswith(a + "/"):
            raise ValueError(f"volume paths {a!r} and {b!r} overlap: mount each volume at its own path")
    return mounts


class VolumeCreate(_Strict):
    name: VolumeName
    size_mb: Annotated[int, Field(ge=1, le=16 * 1024 * 1024, description="quota, MiB: writes beyond it fail "
                                                                         "(EDQUOT) or the next mount is refused")] = 1024


class VolumeInfo(BaseModel):
    id: str
    name: str
    project: str
    size_mb: int
    created_at: datetime
    used_bytes: int | None = Field(None, description="bytes it holds (measured on request)")
    enforced: bool = Field(description="true: the kernel refuses writes beyond size_mb (btrfs quota); "
                                       "false: measured, and a mount of a volume over it is refused")


class VolumeList(BaseModel):
    volumes: list[VolumeInfo]


class VolumeEntry(BaseModel):
    """A file, directory or link of a volume (the volume file API; E2B's VolumeEntryStat)."""

    name: str
    type: str = Field(description="'file', 'directory', 'symlink' or 'unknown' (never followed)")
    path: str = Field(description="from the volume's root, e.g. '/dir/file'")
    size: int
    mode: int = Field(description="permission bits")
    uid: int = Field(description="owner as sandboxes see it (1000: the default user)")
    gid: int
    atime: datetime
    mtime: datetime
    ctime: datetime
    target: str | None = Field(None, description="a symlink's target, as written (not resolved)")


class VolumeEntryList(BaseModel):
    entries: list[VolumeEntry]
