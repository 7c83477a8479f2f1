"""Errors on E2B routes: E2B's `{"code": status, "message": ...}` over HTTP, Connect codes
over envd RPC, and the answer the SDK reads as "the sandbox is gone"."""

from __future__ import annotations

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from fastapi.responses import JSONResponse

from dsec.apiserver.guard import e2b_error_body
from dsec.types import (CapacityExceeded, Conflict, DsecError, Forbidden, InvalidArgument, NotFound,
                        PayloadTooLarge, SandboxFailed, Unauthorized, Unavailable)


class Unsupported(DsecError):
    """An E2B feature dsec does not have: refused by name, never silently ignored."""

    status, code = 400, "unsupported"


class NotImplementedE2B(DsecError):
    status, code = 501, "not_implemented"


class SandboxGone(DsecError):
    """Answered to envd requests of a sandbox that is not running: the SDK recognises
    "was not found" on a 502/UNAVAILABLE as SandboxNotRunningException."""

    status, code = 502, "sandbox_not_found"


def gone(e2b_id: str) -> SandboxGone:
    return SandboxGone(f"The sandbox {e2b_id} was not found", field="E2b-Sandbox-Id",
                       fix="the sandbox was killed or reached its timeout: create a new one")


def e2b_response(error: DsecError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = e2b_error_body(error)
    retry = getattr(error, "retry_after_s", None)
    if retry and headers is None:     # a refusal that passes (the control store is down): when to retry
        headers = {"Retry-After": str(retry)}
    return JSONResponse(body, status_code=body["code"], headers=headers)


_CODES: tuple[tuple[type[DsecError], Code], ...] = (
    (SandboxGone, Code.UNAVAILABLE),
    (NotImplementedE2B, Code.UNIMPLEMENTED),
    (Unsupported, Code.INVALID_ARGUMENT),
    (InvalidArgument, Code.INVALID_ARGUMENT),
    (NotFound, Code.NOT_FOUND),
    (Unauthorized, Code.UNAUTHENTICATED),
    (Forbidden, Code.PERMISSION_DENIED),
    (Conflict, Code.FAILED_PRECONDITION),
    (CapacityExceeded, Code.RESOURCE_EXHAUSTED),
    (PayloadTooLarge, Code.RESOURCE_EXHAUSTED),
    (Unavailable, Code.UNAVAILABLE),
    (SandboxFailed, Code.INTERNAL),
)


def connect_error(e: DsecError) -> ConnectError:
    """The Connect error of a dsec error (its message carries the field and the fix)."""
    code = next((c for cls, c in _CODES if isinstance(e, cls)), Code.INVALID_ARGUMENT if e.status < 500
                else Code.INTERNAL)
    return ConnectError(code, e2b_error_body(e)["message"])
