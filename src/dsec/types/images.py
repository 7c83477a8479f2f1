"""Images (layers are the unit; an image is an ordered list of layers, base first)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import (BaseModel, Field)
from dsec.types.sandboxes import _Strict


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
    kind: str = Field("image", description="'image' (a base), or 'layer' (workspace/toolkit, NAME@VERSION)")
    owner: str | None = Field(None, description="project that owns it (visible to it and its descendants; "
                                                "only it may replace it); None: published to every project")


class ImageList(BaseModel):
    images: list[ImageInfo]


DEFAULT_SCRUB = ("/tmp", "/var/tmp", "/root/.cache", "/work/.cache", "/home/*/.cache",
                 "/root/.bash_history", "/home/*/.bash_history", "/root/.ash_history",
                 "/home/*/.ash_history", "/root/.python_history", "/home/*/.python_history",
                 "/root/.lesshst", "/home/*/.lesshst", "/root/.viminfo", "/home/*/.viminfo")


class PackDiffRequest(_Strict):
    """Turn a sandbox's writable changes into a new workspace layer NAME@VERSION."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,100}@[A-Za-z0-9._+-]{1,26}$",
                               description="NAME@VERSION of the new workspace, e.g. 'myenv@1'")]
    scrub: Annotated[list[Annotated[str, Field(pattern=r"^/[^\x00]{0,1023}$")]] | None,
                     Field(max_length=256, description="absolute paths (fnmatch globs) left out; None: DEFAULT_SCRUB")] = None
    replace: bool = False
