"""Image builds from Dockerfiles, imports and pulls over HTTP (apiserver/image_routes.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import (BaseModel, Field)
from dsec.types.errors import ErrorDetail
from dsec.types.sandboxes import _Strict, NAME_RE
from dsec.types.images import ImageInfo


class ImageConfig(BaseModel):
    """How an image built from a Dockerfile runs (its OCI config: ENV, WORKDIR, USER, CMD...).
    dsec applies none of it by itself: pass env/workdir to the sandbox (adapters do)."""

    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)


class ImageBuildResult(BaseModel):
    image: ImageInfo
    config: ImageConfig = Field(default_factory=ImageConfig)


class ImageProgress(BaseModel):
    """One NDJSON line of a build/import/pull: progress lines, then one with `result` or `error`."""

    message: str = ""
    fraction: float | None = None
    result: ImageBuildResult | None = None
    error: ErrorDetail | None = None


class ImagePullRequest(_Strict):
    name: Annotated[str, Field(pattern=NAME_RE, description="the dsec image name to register")]
    ref: Annotated[str, Field(min_length=1, max_length=1024, description="docker://HOST[:PORT]/REPO[:TAG]")]
    tls_verify: bool = True
    creds: Annotated[str | None, Field(max_length=1024, description="USER:PASSWORD for the registry")] = None
    replace: bool = False
