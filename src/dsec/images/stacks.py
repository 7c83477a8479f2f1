"""Image stacks on one node: base image + workspace + toolkits, as backends consume them.

One place for what every backend did on its own: name lookups (cached briefly, so a burst of
1,000 creations reads the registry once per name), the composition order (base at the
bottom, workspace above, toolkits in the order given, the last topmost), the node's shared
layer mounts (containers) and layer files (VMs).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from dsec.images.service import ImageService
from dsec.types import ImageInfo

IMAGE_CACHE_S = 2.0


class Stacks:
    def __init__(self, images: ImageService):
        self.images = images
        self._names: dict[str, tuple[ImageInfo, float]] = {}
        self._lowers: dict[str, list[Path]] = {}

    async def resolve(self, name: str, field: str = "image") -> ImageInfo:
        """Name -> image; NotFound names `field`."""
        hit = self._names.get(name)
        if hit and hit[1] > time.monotonic():
            return hit[0]
        image = await asyncio.to_thread(self.images.get, name, field)
        self._names[name] = (image, time.monotonic() + IMAGE_CACHE_S)
        return image

    def forget(self, name: str) -> None:
        """The name now means another image (pack_diff wrote it)."""
        self._names.pop(name, None)

    async def stack(self, args: Any) -> list[ImageInfo]:
        """The images of args.image, args.workspace and args.toolkits, bottom first."""
        out = [await self.resolve(args.image)]
        if args.workspace is not None:
            out.append(await self.resolve(args.workspace, "workspace"))
        for i, name in enumerate(args.toolkits):
            out.append(await self.resolve(name, f"toolkits[{i}]"))
        return out

    async def mounted_lowers(self, stack: list[ImageInfo]) -> list[Path]:
        """Mounted layers of the stack, bottom first. A layer listed twice is kept only at its
        topmost position (overlayfs refuses a lowerdir used twice)."""
        lower: list[Path] = []
        if self.images.lazy is not None:      # a dead lazy view: restarted first (lazy.py)
            await asyncio.to_thread(self.images.check_layer_view)
        for part in stack:
            lower += await self._lower_dirs(part)
        seen: set[Path] = set()
        out: list[Path] = []
        for p in reversed(lower):
            if p not in seen:
                seen.add(p)
                out.append(p)
        return out[::-1]

    async def _lower_dirs(self, image: ImageInfo) -> list[Path]:
        """Mounted layers of an image; mounts are per node and digests immutable, so cached.
        Mounted from the layers resolved: a replace of the name since then does not matter."""
        cached = self._lowers.get(image.digest)
        if cached is not None and all(os.path.ismount(p) for p in cached):
            return cached
        lower = await asyncio.to_thread(self.images.mount_image, image)
        self._lowers[image.digest] = lower
        return lower

    def layer_files(self, stack: list[ImageInfo]) -> list[tuple[str, Path]]:
        """(digest, EROFS file) of every layer of the stack, bottom first, each once (topmost)."""
        out: list[tuple[str, Path]] = []
        for part in stack:
            for lay in part.layers:
                out = [x for x in out if x[0] != lay.digest] + [(lay.digest, self.images.layer_source(lay.digest))]
        return out

    async def unmount_all(self) -> None:
        """Nothing on the node uses the layer mounts any more (`dsec down` with no sandbox)."""
        await asyncio.to_thread(self.images.mounts.unmount_all)
        self._lowers.clear()
