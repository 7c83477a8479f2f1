"""What every envd request handler needs: its sandbox (from the E2b-Sandbox-Id header, already
authenticated by the dispatcher), the user it acts as, and absolute paths."""

from __future__ import annotations

import asyncio
import base64
import binascii
import posixpath
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from dsec.apiserver.context import ApiContext, EdgeHandle
from dsec.apiserver.e2b.errors import gone
from dsec.apiserver.e2b.ids import to_dsec
from dsec.apiserver.e2b.mapping import E2B_HOME, e2b_state
from dsec.apiserver.guard import E2B_SANDBOX_HEADER
from dsec.iam.policy import is_root
from dsec.types import USER_RE, DsecError, InvalidArgument, NotFound, SandboxInfo

ENVD_PORT = 49983
PORT_HEADER = "e2b-sandbox-port"
KEEPALIVE_HEADER = "keepalive-ping-interval"   # seconds between keepalives of a server stream
HOME = E2B_HOME     # the default user's home: the workdir of sandboxes created through E2B
ROOT_HOME = "/root"
ACCOUNT_RE = r"^[a-z_][a-z0-9_.-]{0,31}$"     # useradd's user names


@dataclass(frozen=True)
class Target:
    e2b_id: str
    sandbox_id: str
    edge: EdgeHandle
    info: SandboxInfo


async def target_of(ctx: ApiContext, headers: Mapping[str, str]) -> Target:
    """The live sandbox a request is for; a missing or ended one is "not found" as E2B's proxy
    answers it (502/UNAVAILABLE: the SDK raises SandboxNotRunningException)."""
    e2b_id = headers.get(E2B_SANDBOX_HEADER, "")
    try:
        sandbox_id = to_dsec(e2b_id)
        edge = ctx.edge_for(sandbox_id)
        info = await edge.get(sandbox_id)
    except NotFound:
        raise gone(e2b_id[:80]) from None
    if e2b_state(info) is None:
        raise gone(e2b_id)
    return Target(e2b_id, sandbox_id, edge, info)


def user_of(headers: Mapping[str, str]) -> str | None:
    """The user of an envd request (`Authorization: Basic base64("user:")`): E2B's "user" is
    the sandbox's own user (None), "root" is root; dsec user specs pass as they are."""
    auth = headers.get("authorization", "")
    if not auth.lower().startswith("basic "):
        return None
    try:
        name = base64.b64decode(auth[6:].strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise InvalidArgument("the Authorization header is not Basic base64(user:)", field="user",
                              fix="pass user='user' or user='root'") from None
    return user_name(name)


def user_name(name: str | None) -> str | None:
    """E2B's user name as dsec's user: None for `user` (the default), dsec's own specs as they
    are, any other account name as given (account() resolves it in the sandbox)."""
    if not name or name == "user":
        return None
    if not (re.match(USER_RE, name) or re.match(ACCOUNT_RE, name)):
        raise InvalidArgument(f"user {name[:40]!r} is not a user name", field="user",
                              fix="use 'user' (the default user), 'root' or a user of the sandbox's image")
    return name


async def account(t: Target, user: str | None) -> str | None:
    """`user` as dsec acts as it: a name of the image's own accounts becomes its UID:GID, from
    the sandbox's /etc/passwd (read inside the sandbox, as root, through the agent)."""
    if user is None or re.match(USER_RE, user):
        return user
    try:
        text = (await t.edge.read_file(t.sandbox_id, "/etc/passwd", 1 << 20, user="root")).decode("utf-8", "replace")
    except DsecError:
        text = ""
    for line in text.splitlines():
        p = line.split(":")
        if len(p) >= 7 and p[0] == user and p[2].isdigit() and p[3].isdigit():
            return f"{int(p[2])}:{int(p[3])}"
    raise InvalidArgument(f"user {user!r} does not exist in the sandbox (no entry in its /etc/passwd)",
                          field="user", fix="use 'user' (the default user), 'root', or create the user first")


def home_of(user: str | None) -> str:
    """The home of a request's user, as envd has it: /root for root, else the default user's."""
    return ROOT_HOME if is_root(user) else HOME


def abs_path(path: str, field: str = "path", user: str | None = None) -> str:
    """envd resolves relative paths against the acting user's home (home_of)."""
    if not path:
        raise InvalidArgument("path is empty", field=field, fix="pass a file path")
    if "\0" in path:
        raise InvalidArgument("path contains a NUL byte", field=field, fix="pass a plain file path")
    return posixpath.normpath(posixpath.join(home_of(user), path))


T = TypeVar("T")


async def with_keepalive(events: AsyncIterator[T], interval_s: float | None) -> AsyncIterator[T | None]:
    """The events, with None every `interval_s` of silence (envd's keepalive pings)."""
    it = aiter(events)
    nxt: asyncio.Future[T] | None = None
    try:
        while True:
            nxt = nxt or asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({nxt}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield ev
    finally:
        if nxt is not None:
            nxt.cancel()
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def keepalive_s(headers: Mapping[str, str]) -> float | None:
    raw = headers.get(KEEPALIVE_HEADER, "")
    try:
        return max(1.0, float(raw)) if raw else None
    except ValueError:
        return None
