"""E2B's user layout in the sandboxes created through the E2B mount.

E2B code expects a default user `user` (uid 1000) whose home /home/user is the cwd and HOME of
commands. The home is the sandbox's workdir (mapping.E2B_HOME: the agent makes it, owned by the
sandbox's uid 1000); this module adds the account: `user:x:1000:1000::/home/user:SHELL` in
/etc/passwd and `user:x:1000:` in /etc/group, placed *before* any other entry of id 1000 (dsec's
images name uid 1000 `sandbox`), so that getpwuid(1000) -- whoami, ls -l, Python's
getpass.getuser() -- says `user` while `sandbox` still resolves by name.

The edit is made inside the sandbox, through the agent's file API as root (the agent resolves
every path in the sandbox's own root, without /proc magic links), never by the host in the
image's layers. /etc/passwd or /etc/group that is not a regular file (a symlink planted by the
image) is left alone: the layout is then incomplete, never written through the link.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dsec.apiserver.context import EdgeHandle
from dsec.apiserver.e2b.mapping import E2B_HOME
from dsec.types import DsecError, NotFound, SandboxInfo

log = logging.getLogger("dsec.apiserver.e2b")

USER, UID = "user", 1000
MAX_BYTES = 1 << 20


def _insert(text: str, line: str, name: str, id_field: int) -> str | None:
    """`text` (passwd or group) with `line` added before the first entry whose id field is
    UID (else at the end); None when `name` already has an entry."""
    lines = text.splitlines()
    if any(ln.split(":", 1)[0] == name for ln in lines):
        return None
    at = next((i for i, ln in enumerate(lines)
               if len(parts := ln.split(":")) > id_field and parts[id_field] == str(UID)), len(lines))
    lines.insert(at, line)
    return "\n".join(lines) + "\n"


def with_user(passwd: str) -> str | None:
    """/etc/passwd with E2B's `user` (None: already there). Its shell: that of the entry it
    shadows (busybox images have no bash), else /bin/bash as on E2B."""
    shell = next((p[6] for ln in passwd.splitlines() if len(p := ln.split(":")) >= 7 and p[2] == str(UID)),
                 "/bin/bash")
    return _insert(passwd, f"{USER}:x:{UID}:{UID}::{E2B_HOME}:{shell}", USER, 2)


def with_group(group: str) -> str | None:
    """/etc/group with E2B's `user` group (None: already there)."""
    return _insert(group, f"{USER}:x:{UID}:", USER, 2)


async def _edit(edge: EdgeHandle, sandbox_id: str, path: str, change: Callable[[str], str | None],
                missing: str) -> None:
    """Rewrite `path` (in /etc) as `change` says, as root inside the sandbox; a missing file
    is made from `missing` (its root entry), one that is not a regular file is left alone."""
    name = path.rsplit("/", 1)[1]
    kinds = {e.name: e.type for e in await edge.list_dir(sandbox_id, "/etc", user="root")}
    if name in kinds and kinds[name] != "file":
        log.warning("E2B layout: %s is a %s, left alone", path, kinds[name], extra={"sandbox": sandbox_id})
        return
    try:
        old = (await edge.read_file(sandbox_id, path, MAX_BYTES, user="root")).decode("utf-8", "replace")
    except NotFound:
        old = missing
    new = change(old)
    if new is not None:
        await edge.write_file(sandbox_id, path, new.encode(), 0o644, True, user="root")


async def apply(edge: EdgeHandle, info: SandboxInfo) -> None:
    """Add E2B's `user` account to a sandbox just created through the E2B mount. A failure
    is logged, not fatal: the sandbox works, whoami just says `sandbox`."""
    try:
        await _edit(edge, info.id, "/etc/passwd", with_user, "root:x:0:0:root:/root:/bin/sh\n")
        await _edit(edge, info.id, "/etc/group", with_group, "root:x:0:\n")
    except DsecError as e:
        log.warning("E2B layout not applied", extra={"sandbox": info.id, "error": e.message})
