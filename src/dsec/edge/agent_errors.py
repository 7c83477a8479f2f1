"""Agent errors (errno from inside the sandbox) as API errors naming the field and the fix."""

from __future__ import annotations

import os

from dsec.agent.client import AgentError
from dsec.types import CapacityExceeded, Conflict, DsecError, InvalidArgument, NotFound

ERRNO_TO_ERROR = {2: NotFound, 13: InvalidArgument, 21: InvalidArgument, 20: InvalidArgument,
                  16: Conflict, 39: Conflict, 17: Conflict, 36: InvalidArgument, 27: InvalidArgument,
                  122: Conflict, 28: Conflict, 40: InvalidArgument, 11: CapacityExceeded,
                  7: InvalidArgument}
ERRNO_FIX = {2: "check the path (relative paths are relative to the sandbox workdir)",
             13: "the sandbox user may not access it; create the sandbox with user='root' if needed",
             1: "the files API writes only where commands may: not in /proc, /sys, /dev (but /dev/shm, "
                "/dev/mqueue), /.dsec, nor files directly in /; use a path under the workdir",
             21: "the path is a directory; use files.list", 20: "a parent of the path is not a directory",
             16: "wait for the running command in this session to finish, or use another session",
             39: "the directory is not empty", 17: "the path already exists",
             27: "the file is too large for one call",
             122: "the sandbox's writable layer is full (disk_mb): delete files, or create it with a larger disk_mb",
             28: "the sandbox's writable layer is full (disk_mb): delete files, or create it with a larger disk_mb",
             11: "the sandbox is out of processes (pids_limit) or memory: wait for background processes to "
                 "exit, kill them, or create the sandbox with a larger pids_limit/memory_mb",
             7: "the command is too long for one exec (128 KiB): write it to a file and run that",
             40: "paths through /proc magic links (e.g. /proc/PID/root, /proc/PID/fd) are refused; use the plain path"}


def check_path(path: str) -> None:
    if not path or "\0" in path or len(path) > 4096:
        raise InvalidArgument(f"bad path {path!r}", field="path",
                              fix="give an absolute path inside the sandbox, or one relative to its workdir")


CWD_FIX = ("pass an existing directory as cwd (create it first, e.g. `mkdir -p DIR` in an earlier command), "
           "or leave cwd unset to start in the sandbox's workdir")


def map_agent_error(e: AgentError, field: str) -> DsecError:
    """The API error for an agent's answer about `field` of the request. A command ("cmd") that
    could not start because its directory is missing or no directory is about the exec's cwd."""
    cls = ERRNO_TO_ERROR.get(e.errno, InvalidArgument)
    fix = ERRNO_FIX.get(e.errno)
    if field == "cmd" and e.message.startswith("chdir "):   # the agent's start-up stage "chdir DIR: ..."
        field, fix = "cwd", CWD_FIX
    return cls(f"{e.message} ({os.strerror(e.errno) if e.errno else 'error'})", field=field, fix=fix)


def watch_error(e: AgentError) -> DsecError:
    """The API error for a refused or ended directory watch."""
    if e.errno == 7:       # E2BIG
        return InvalidArgument(e.message, field="recursive",
                               fix="watch a smaller tree, or the directory alone (recursive=false)")
    if e.errno == 11:      # EAGAIN: the agent's watch limit
        return CapacityExceeded(e.message, field="path", fix="stop a watch of this sandbox first")
    if e.errno == 2 and e.message.endswith("was removed"):
        return NotFound(e.message, field="path", fix="watch an existing directory")
    return map_agent_error(e, "path")
