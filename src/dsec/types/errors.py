"""Errors: every failure a user can cause names the field and the fix (code, HTTP status, field, fix)."""

from __future__ import annotations

from typing import Any

from pydantic import (BaseModel, Field)


class DsecError(Exception):
    """A failure with a stable code, the offending field (if any) and how to fix it."""

    status: int = 400
    code: str = "bad_request"
    reason: str | None = None    # a request to an ended sandbox: its end reason (types/events.py)

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.fix = fix
        if reason is not None:
            self.reason = reason

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message, "field": self.field, "fix": self.fix}
        if self.reason:
            body["reason"] = self.reason
        return {"error": body}


class InvalidArgument(DsecError):
    status, code = 422, "invalid_argument"


class NotFound(DsecError):
    status, code = 404, "not_found"


class Unauthorized(DsecError):
    status, code = 401, "unauthorized"


class Forbidden(DsecError):
    status, code = 403, "forbidden"


class Conflict(DsecError):
    """The target exists but is in a state that does not allow the operation."""

    status, code = 409, "conflict"


class CapacityExceeded(DsecError):
    """Admission refused: the node (or quota) is full. Callers may place elsewhere."""

    status, code = 429, "capacity_exceeded"


class SandboxFailed(DsecError):
    # 502: the sandbox (the upstream of this request) failed, not the server (500 is for bugs)
    status, code = 502, "sandbox_failed"


class Unavailable(DsecError):
    status, code = 503, "unavailable"


class NodeUnreachable(Unavailable):
    """A node's edge did not answer. `delivered` False: the request never reached it (the
    connection was refused or not made), so placement may try another node; True: it may have
    taken effect there."""

    delivered: bool = True


class PayloadTooLarge(DsecError):
    """The request body is larger than its route accepts (the apiserver's body limits)."""

    status, code = 413, "payload_too_large"


class BadGateway(DsecError):
    """A server inside a sandbox answered with something that is not valid HTTP (port ingress)."""

    status, code = 502, "bad_gateway"


class GatewayTimeout(DsecError):
    """A server inside a sandbox accepted the connection but did not answer in time."""

    status, code = 504, "gateway_timeout"


class InternalError(DsecError):
    """A bug in dsec, not in the request: the server log has the details."""

    status, code = 500, "internal"


ERRORS_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls for cls in (DsecError, InvalidArgument, NotFound, Unauthorized, Forbidden,
                              Conflict, CapacityExceeded, SandboxFailed, Unavailable, PayloadTooLarge,
                              BadGateway, GatewayTimeout, InternalError)
}


class ErrorDetail(BaseModel):
    code: str = Field(description="stable code, e.g. 'invalid_argument', 'not_found', 'conflict'")
    message: str
    field: str | None = Field(description="the request field at fault (dotted path), if any")
    fix: str | None = Field(description="what to change so that the request succeeds, if known")
    reason: str | None = Field(None, description="a request to a sandbox that ended: why it ended, one word of "
                                                 "docs/events.md's vocabulary (e.g. oom_killed, ttl)")


class ErrorBody(BaseModel):
    """The body of every error response (DsecError.to_body)."""

    error: ErrorDetail
