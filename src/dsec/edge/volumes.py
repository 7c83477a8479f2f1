"""Volume verbs of the edge: create, list, delete, and resolving a create's mounts.
"""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

from dsec.backends.base import VolumeDirs
from dsec.types import (PayloadTooLarge, Conflict, InvalidArgument, SandboxArgs, SandboxState, Unavailable,
                        VolumeCreate, VolumeEntry, VolumeInfo)
from dsec.volumes.files import VolumeFiles
from dsec.volumes.store import VolumeStore
from dsec.edge.core import EdgeCore, log

_HOLDING = (SandboxState.creating, SandboxState.running, SandboxState.suspended)


class VolumeVerbs(EdgeCore):
    def _volumes(self) -> VolumeStore:
        for b in self._distinct_backends():
            if isinstance(b, VolumeDirs):
                return VolumeStore(b)
        raise Unavailable(f"node {self.node_id} has no container backend, which keeps volumes",
                          field="volumes", fix="run the container backend on this node (dsec up), or use "
                                               "a node that has it")

    async def create_volume(self, project: str, req: VolumeCreate) -> VolumeInfo:
        store = self._volumes()
        limit = int(self.conf.storage.volumes_project_gb * 1024)
        r = await asyncio.to_thread(store.create, project, req, limit)
        log.info("volume created", extra={"volume": r["id"], "project": project, "size_mb": req.size_mb})
        return store.info(r, 0)

    async def list_volumes(self, project: str | None = None, usage: bool = False) -> builtins.list[VolumeInfo]:
        store = self._volumes()

        def read() -> builtins.list[VolumeInfo]:
            return [store.info(r, store.usage(r) if usage else None) for r in store.records(project)]
        return await asyncio.to_thread(read)

    def _holders(self, project: str, name: str) -> builtins.list[str]:
        return sorted(live.id for live in self._live.values()
                      if live.rec.project == project and live.rec.state in _HOLDING
                      and any(m.name == name for m in getattr(live.rec.args, "volumes", ())))

    async def volume_holders(self, project: str, name: str) -> builtins.list[str]:
        """This node's sandboxes (running, parked or being created) that mount the volume: a
        cluster whose nodes share DSEC_VOLUMES_DIR asks every node before a delete."""
        return self._holders(project, name)

    async def delete_volume(self, project: str, name: str) -> None:
        """Refused while a sandbox of this node (running, parked or being created) mounts it."""
        store = self._volumes()
        r = await asyncio.to_thread(store.find, project, name)
        holders = self._holders(project, name)
        if holders:
            raise Conflict(f"volume {name!r} is mounted by {len(holders)} sandbox(es): {', '.join(holders[:5])}",
                           field="name", fix="stop those sandboxes first, then delete the volume")
        await asyncio.to_thread(store.delete, r)
        log.info("volume deleted", extra={"volume": r["id"], "project": project})

    # -- files (the volume file API): a volume of the caller's project, by name -------------
    def _files(self, project: str, name: str) -> VolumeFiles:
        """(file reads: call in a thread)"""
        store = self._volumes()
        r = store.find(project, name)
        if store.dirs.volumes_enforced:
            return VolumeFiles(store.data_dir(r))      # the kernel refuses writes past the qgroup

        def room(n: int) -> None:
            used, size = store.usage(r), r["size_mb"] << 20
            if used + n > size:
                raise PayloadTooLarge(f"volume {name!r} holds {used} bytes; {n} more would pass its "
                                       f"size_mb={r['size_mb']}", field="size_mb",
                                       fix="remove files from the volume, or create a larger one")
        return VolumeFiles(store.data_dir(r), room)

    async def volume_stat(self, project: str, name: str, path: str) -> VolumeEntry:
        return await asyncio.to_thread(lambda: self._files(project, name).stat(path))

    async def volume_read(self, project: str, name: str, path: str, maxlen: int = 64 << 20) -> bytes:
        return await asyncio.to_thread(lambda: self._files(project, name).read(path, maxlen))

    async def volume_write(self, project: str, name: str, path: str, data: bytes, uid: int | None = None,
                           gid: int | None = None, mode: int | None = None, mkdirs: bool = True) -> VolumeEntry:
        return await asyncio.to_thread(lambda: self._files(project, name).write(path, data, uid, gid, mode, mkdirs))

    async def volume_mkdir(self, project: str, name: str, path: str, uid: int | None = None,
                           gid: int | None = None, mode: int | None = None, parents: bool = False) -> VolumeEntry:
        return await asyncio.to_thread(lambda: self._files(project, name).mkdir(path, uid, gid, mode, parents))

    async def volume_update(self, project: str, name: str, path: str, uid: int | None = None,
                            gid: int | None = None, mode: int | None = None) -> VolumeEntry:
        return await asyncio.to_thread(lambda: self._files(project, name).update(path, uid, gid, mode))

    async def volume_entries(self, project: str, name: str, path: str, depth: int = 1) -> builtins.list[VolumeEntry]:
        return await asyncio.to_thread(lambda: self._files(project, name).entries(path, depth))

    async def volume_remove(self, project: str, name: str, path: str) -> None:
        await asyncio.to_thread(lambda: self._files(project, name).remove(path))

    async def _resolve_volumes(self, project: str, args: SandboxArgs) -> builtins.list[tuple[str, str, bool]]:
        """(host dir, path, read-only) of each mount of a create: volumes of the sandbox's own
        project only. Where the quota is measured rather than enforced, a read-write mount of a
        volume over its size is refused here."""
        mounts: Any = getattr(args, "volumes", None) or []
        if not mounts:
            return []
        store = self._volumes()

        def resolve() -> builtins.list[tuple[str, str, bool]]:
            out = []
            for i, m in enumerate(mounts):
                r = store.find(project, m.name, field=f"volumes[{i}].name")
                if not store.dirs.volumes_enforced and not m.read_only:
                    used = store.usage(r)
                    if used > r["size_mb"] << 20:
                        raise InvalidArgument(
                            f"volume {m.name!r} holds {used >> 20} MiB, more than its size_mb={r['size_mb']}",
                            field=f"volumes[{i}]", fix="mount it read_only to read it, or delete it and create "
                                                       "a larger volume")
                out.append((str(store.data_dir(r)), m.path, m.read_only))
            return out
        return await asyncio.to_thread(resolve)
