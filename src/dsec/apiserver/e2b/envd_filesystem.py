"""envd's `filesystem.Filesystem` Connect service.

ListDir and Remove use the edge's file primitives; Stat, MakeDir and Move have none, so they
run `stat`, `mkdir -p` and `mv` inside the sandbox (one short exec each; images need those
tools, which busybox and coreutils both have). Directory watching: envd_watch.py.
"""

from __future__ import annotations

import posixpath
import shlex
import stat as st
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from protobuf.wkt import Timestamp

from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication

from dsec.apiserver.context import ApiContext
from dsec.apiserver.control import check_file_user_in
from dsec.apiserver.e2b.control import check_exec
from dsec.apiserver.e2b.envd_common import (Target, abs_path, account, keepalive_s, target_of, user_of,
                                            with_keepalive)
from dsec.apiserver.e2b.envd_files import denied
from dsec.apiserver.e2b.envd_watch import Watchers, fs_event, open_watch
from dsec.apiserver.e2b.errors import connect_error
from dsec.types import DsecError, ExecRequest, ExecResult, FileEntry, NotFound

STAT_FMT = "%F|%s|%a|%U|%G|%Y"
KINDS = {"directory": pb.FileType.DIRECTORY, "regular file": pb.FileType.FILE,
         "regular empty file": pb.FileType.FILE, "symbolic link": pb.FileType.SYMLINK}
LIST_KINDS = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY, "symlink": pb.FileType.SYMLINK}
EXISTS = 17      # exit code of the mkdir script when the path exists (EEXIST)
MAX_DEPTH = 16


def stat_script(path: str) -> str:
    """One line `type|size|perm|owner|group|mtime` (of the target, for a link that resolves),
    then `L|target` for a symlink."""
    p = shlex.quote(path)
    return (f"S=$(stat -L -c '{STAT_FMT}' -- {p} 2>/dev/null || stat -c '{STAT_FMT}' -- {p}) || exit $?; "
            f"echo \"$S\"; if [ -L {p} ]; then printf 'L|%s\\n' \"$(readlink -- {p})\"; fi; exit 0")


def permissions(kind: int, perm: int) -> str:
    """Go's FileMode.String(), as envd reports it: 'drwxr-xr-x', '-rw-r--r--', 'Lrwxrwxrwx'."""
    lead = {pb.FileType.DIRECTORY: "d", pb.FileType.SYMLINK: "L"}.get(kind, "-")   # type: ignore[call-overload]
    return lead + st.filemode(perm)[1:]


def entry_from_stat(path: str, out: str) -> pb.EntryInfo:
    lines = out.strip().splitlines()
    kind_s, size, perm, owner, group, mtime = lines[0].split("|", 5)
    link = next((line[2:] for line in lines[1:] if line.startswith("L|")), None)
    kind = KINDS.get(kind_s, pb.FileType.UNSPECIFIED)
    perm_i = int(perm, 8) & 0o777
    e = pb.EntryInfo(name=posixpath.basename(path) or "/", type=kind, path=path, size=int(size), mode=perm_i,
                     permissions=permissions(kind, perm_i), owner=owner, group=group,
                     modified_time=_ts(float(mtime)), is_symlink=link is not None)
    if link is not None:
        e.symlink_target = link
    return e


def entry_from_list(directory: str, f: FileEntry) -> pb.EntryInfo:
    kind = LIST_KINDS.get(f.type, pb.FileType.UNSPECIFIED)
    perm = f.mode & 0o777
    # owner/group: the edge's listing has no owners (get_info/Stat has them)
    return pb.EntryInfo(name=f.name, type=kind, path=posixpath.join(directory, f.name), size=f.size, mode=perm,
                        permissions=permissions(kind, perm), owner="", group="", modified_time=_ts(f.mtime),
                        is_symlink=f.type == "symlink")


def _ts(t: float) -> Timestamp:
    return Timestamp.from_datetime(datetime.fromtimestamp(t, timezone.utc))


def exec_failure(r: ExecResult, path: str) -> ConnectError:
    """The Connect error of a failed helper command, from what it printed."""
    err = (r.stderr or r.stdout).strip()
    low = err.lower()
    if "no such file" in low or "can't stat" in low and "no such" in low:
        return ConnectError(Code.NOT_FOUND, f"path {path!r} not found: {err[:300]}")
    if "permission denied" in low or "operation not permitted" in low:
        return ConnectError(Code.PERMISSION_DENIED, f"{path!r}: {err[:300]}")
    if "not a directory" in low or "is a directory" in low or "cannot move" in low:
        return ConnectError(Code.INVALID_ARGUMENT, f"{path!r}: {err[:300]}")
    return ConnectError(Code.INTERNAL, f"{path!r}: command failed with exit code {r.exit_code}: {err[:300]}")


class FilesystemService:
    """filesystem.Filesystem for the sandbox named by each request's E2b-Sandbox-Id header."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        self.watchers = Watchers(ctx)

    async def _target(self, rc: RequestContext) -> tuple[Target, str | None]:
        try:
            t = await target_of(self.ctx, rc.request_headers)
            return t, await account(t, user_of(rc.request_headers))
        except DsecError as e:
            raise connect_error(e) from None

    async def _sh(self, t: Target, user: str | None, script: str) -> ExecResult:
        req = ExecRequest(cmd=script, user=user, timeout_s=60)
        try:
            check_exec(self.ctx, t.info.project, req)
            return await t.edge.run(t.sandbox_id, req)
        except DsecError as e:
            raise connect_error(e) from None

    async def _stat(self, t: Target, user: str | None, path: str) -> pb.EntryInfo:
        r = await self._sh(t, user, stat_script(path))
        if r.exit_code != 0:
            raise exec_failure(r, path)
        return entry_from_stat(path, r.stdout)

    async def stat(self, request: pb.StatRequest, ctx: RequestContext) -> pb.StatResponse:
        t, user = await self._target(ctx)
        return pb.StatResponse(entry=await self._stat(t, user, _path(request.path, user=user)))

    async def make_dir(self, request: pb.MakeDirRequest, ctx: RequestContext) -> pb.MakeDirResponse:
        t, user = await self._target(ctx)
        path = _path(request.path, user=user)
        p = shlex.quote(path)
        r = await self._sh(t, user, f"if [ -e {p} ] || [ -L {p} ]; then exit {EXISTS}; fi; mkdir -p -- {p}")
        if r.exit_code == EXISTS:
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {path!r} already exists")
        if r.exit_code != 0:
            raise exec_failure(r, path)
        return pb.MakeDirResponse(entry=await self._stat(t, user, path))

    async def move(self, request: pb.MoveRequest, ctx: RequestContext) -> pb.MoveResponse:
        t, user = await self._target(ctx)
        src, dst = _path(request.source, "source", user), _path(request.destination, "destination", user)
        q_src, q_dst, q_dir = shlex.quote(src), shlex.quote(dst), shlex.quote(posixpath.dirname(dst))
        r = await self._sh(t, user, f"[ -e {q_src} ] || [ -L {q_src} ] || {{ echo 'No such file' >&2; exit 2; }}; "
                                    f"mkdir -p -- {q_dir} && mv -f -- {q_src} {q_dst}")
        if r.exit_code != 0:
            raise exec_failure(r, src)
        return pb.MoveResponse(entry=await self._stat(t, user, dst))

    async def list_dir(self, request: pb.ListDirRequest, ctx: RequestContext) -> pb.ListDirResponse:
        t, user = await self._target(ctx)
        depth = min(max(request.depth, 1), MAX_DEPTH)
        entries: list[pb.EntryInfo] = []
        path = _path(request.path, user=user)
        try:
            check_file_user_in(self.ctx, t.info.project, user)
            await self._walk(t, user, path, depth, entries)
        except DsecError as e:
            raise connect_error(denied(e, user, path)) from None
        return pb.ListDirResponse(entries=entries)

    async def _walk(self, t: Target, user: str | None, directory: str, depth: int, out: list[pb.EntryInfo]) -> None:
        for f in await t.edge.list_dir(t.sandbox_id, directory, user=user):   # as the request's user
            out.append(entry_from_list(directory, f))
            if f.type == "dir" and depth > 1:
                await self._walk(t, user, posixpath.join(directory, f.name), depth - 1, out)

    async def remove(self, request: pb.RemoveRequest, ctx: RequestContext) -> pb.RemoveResponse:
        t, user = await self._target(ctx)
        path = _path(request.path, user=user)
        try:
            check_file_user_in(self.ctx, t.info.project, user)
            await t.edge.remove_file(t.sandbox_id, path, user=user)     # as the request's user
            return pb.RemoveResponse()
        except NotFound as e:
            raise connect_error(e) from None
        except DsecError as e:
            if e.status == 403:
                raise connect_error(e) from None
            # not empty (the edge removes one entry): envd removes a tree
        r = await self._sh(t, user, f"[ -e {shlex.quote(path)} ] || [ -L {shlex.quote(path)} ] || "
                                    f"{{ echo 'No such file' >&2; exit 2; }}; rm -rf -- {shlex.quote(path)}")
        if r.exit_code != 0:
            raise exec_failure(r, path)
        return pb.RemoveResponse()

    def watch_dir(self, request: pb.WatchDirRequest, ctx: RequestContext) -> AsyncIterator[pb.WatchDirResponse]:
        return self._watch_dir(request, ctx)

    async def _watch_dir(self, request: pb.WatchDirRequest, ctx: RequestContext
                         ) -> AsyncIterator[pb.WatchDirResponse]:
        """start once the agent watches the directory, then its changes; keepalives in silences."""
        t, user = await self._target(ctx)
        events = await open_watch(self.ctx, t, user, _path(request.path, user=user), request.recursive)
        yield pb.WatchDirResponse(event=Oneof("start", pb.WatchDirResponse.StartEvent()))
        try:
            async for ev in with_keepalive(events, keepalive_s(ctx.request_headers)):
                if ev is None:
                    yield pb.WatchDirResponse(event=Oneof("keepalive", pb.WatchDirResponse.KeepAlive()))
                elif (m := fs_event(ev)) is not None:
                    yield pb.WatchDirResponse(event=Oneof("filesystem", m))
        except DsecError as e:
            raise connect_error(e) from None

    async def create_watcher(self, request: pb.CreateWatcherRequest, ctx: RequestContext
                             ) -> pb.CreateWatcherResponse:
        t, user = await self._target(ctx)
        watcher_id = await self.watchers.create(t, user, _path(request.path, user=user), request.recursive)
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest, ctx: RequestContext
                                 ) -> pb.GetWatcherEventsResponse:
        t, _ = await self._target(ctx)
        return pb.GetWatcherEventsResponse(events=self.watchers.events(t, request.watcher_id))

    async def remove_watcher(self, request: pb.RemoveWatcherRequest, ctx: RequestContext
                             ) -> pb.RemoveWatcherResponse:
        t, _ = await self._target(ctx)
        await self.watchers.remove(t, request.watcher_id)
        return pb.RemoveWatcherResponse()


def _path(path: str, field: str = "path", user: str | None = None) -> str:
    try:
        return abs_path(path, field, user)
    except DsecError as e:
        raise connect_error(e) from None


def filesystem_app(ctx: ApiContext) -> FilesystemASGIApplication:
    return FilesystemASGIApplication(FilesystemService(ctx))  # type: ignore[arg-type]
