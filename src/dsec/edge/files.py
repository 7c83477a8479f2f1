"""Files: read, write, list, remove, watch, through the agent as the sandbox user or the user a
call names (root, 'sandbox', UID[:GID]): the agent sets its filesystem ids to that user's for
the call, so permission checks and the owner of created files are that user's.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator

from dsec.agent.client import AgentError, DirEntry
from dsec.edge.agent_errors import check_path, map_agent_error, watch_error
from dsec.edge.live import LiveSandbox
from dsec.security.users import resolve_user
from dsec.types import CapacityExceeded, FileEntry, FsEvent
from dsec.edge.core import MAX_WATCHES_PER_PROJECT, EdgeCore


def _ids(live: LiveSandbox, user: str | None) -> tuple[int, int]:
    """The uid/gid a file call acts as: the named user's, else the sandbox's own."""
    return resolve_user(user) if user else (live.rec.uid, live.rec.gid)


class Files(EdgeCore):
    async def read_file(self, sandbox_id: str, path: str, maxlen: int = 64 << 20, user: str | None = None) -> bytes:
        check_path(path)
        async with self._use(sandbox_id) as (live, agent):
            uid, gid = _ids(live, user)
            try:
                return await agent.read_file(path, uid=uid, gid=gid, maxlen=maxlen)
            except AgentError as e:
                raise map_agent_error(e, "path") from e

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644,
                         mkdirs: bool = True, user: str | None = None) -> None:
        check_path(path)
        async with self._use(sandbox_id) as (live, agent):
            uid, gid = _ids(live, user)
            try:
                await agent.write_file(path, data, uid=uid, gid=gid, mode=mode, mkdirs=mkdirs)
            except AgentError as e:
                raise map_agent_error(e, "path") from e

    async def list_dir(self, sandbox_id: str, path: str, user: str | None = None) -> builtins.list[FileEntry]:
        check_path(path)
        async with self._use(sandbox_id) as (live, agent):
            uid, gid = _ids(live, user)
            try:
                entries: builtins.list[DirEntry] = await agent.list_dir(path, uid=uid, gid=gid)
            except AgentError as e:
                raise map_agent_error(e, "path") from e
        return [FileEntry(name=e.name, type=e.kind, size=e.size, mode=e.mode, mtime=e.mtime) for e in entries]

    async def remove_file(self, sandbox_id: str, path: str, user: str | None = None) -> None:
        check_path(path)
        async with self._use(sandbox_id) as (live, agent):
            uid, gid = _ids(live, user)
            try:
                await agent.remove(path, uid=uid, gid=gid)
            except AgentError as e:
                raise map_agent_error(e, "path") from e

    async def watch_dir(self, sandbox_id: str, path: str, recursive: bool = False,
                        user: str | None = None) -> AsyncIterator[FsEvent]:
        """Changes below directory `path` as they happen: first `start` once the agent watches it,
        then one event per change, until the caller stops (or the directory goes: NotFound). As
        the sandbox's user (or `user`); the sandbox counts as busy meanwhile."""
        check_path(path)
        async with self._use(sandbox_id) as (live, agent):
            project = live.rec.project
            if self._watches[project] >= MAX_WATCHES_PER_PROJECT:     # the agent caps each sandbox
                raise CapacityExceeded(f"project {project} already has {MAX_WATCHES_PER_PROJECT} open directory "
                                       "watches on this node", field="path", fix="stop some of its watches first")
            uid, gid = _ids(live, user)
            try:
                changes = await agent.watch(path, uid=uid, gid=gid, recursive=recursive)
            except AgentError as e:
                raise watch_error(e) from e
            self._watches[project] += 1
            try:
                yield FsEvent(type="start")
                async for batch in changes:     # an `overflow` (a reader too slow) ends it
                    for c in batch:
                        yield FsEvent(type=c.kind, name=c.name, is_dir=c.is_dir)
            except AgentError as e:
                raise watch_error(e) from e
            finally:
                self._watches[project] -= 1
                if self._watches[project] <= 0:
                    del self._watches[project]
                await changes.aclose()
