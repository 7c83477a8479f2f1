"""Which uid/gid a sandbox's commands run as. Non-root by default."""

from __future__ import annotations

from dsec.types import InvalidArgument

SANDBOX_UID = SANDBOX_GID = 1000


def resolve_user(user: str | None) -> tuple[int, int]:
    if user in (None, "sandbox"):
        return SANDBOX_UID, SANDBOX_GID
    if user == "root":
        return 0, 0
    uid_s, _, gid_s = user.partition(":")
    if not uid_s.isdigit() or (gid_s and not gid_s.isdigit()):
        raise InvalidArgument(f"bad user {user!r}", field="user", fix="use None, 'root', 'sandbox' or 'UID[:GID]'")
    uid = int(uid_s)
    return uid, int(gid_s) if gid_s else uid
