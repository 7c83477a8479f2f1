"""Lifecycle events and the one end-reason vocabulary (docs/events.md).

Every sandbox that ends says why with one machine word beside its free-text message: the
infrastructure's fault (a trainer masks these instead of scoring them as a zero reward) or the
user's own end (a stop, a TTL, a lifetime, the sandbox's own doing). Every backend maps its
deaths onto these words; the SDK raises SandboxEnded subclasses carrying them.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dsec.types.errors import DsecError

# The infrastructure ended it: not the task's fault.
INFRASTRUCTURE_REASONS = frozenset({
    "node_lost",       # its node (or the edge holding it) went away or restarted
    "oom_killed",      # the kernel's OOM killer ended the sandbox's init (its own memory_mb was spent)
    "host_pressure",   # the OOM killer ended it below its own limit: the host or the node's cgroup ran out
    "preempted",       # the platform took the capacity back (`dsec nodes drain --stop`)
    "agent_died",      # the sandbox's agent/runtime died or hung (killed from outside, crashed)
    "create_failed",   # it never started: the runtime failed while creating it
})
# The user ended it, directly or by what they asked for.
USER_REASONS = frozenset({
    "killed",          # stopped through the API, SDK, CLI or E2B's kill
    "ttl",             # idle for longer than ttl_idle_s
    "lifetime",        # its absolute lifetime ended (lifetime_s, set_timeout)
    "disk_quota",      # its writable layer grew past disk_mb
    "exited",          # the sandbox shut itself down (a VM guest's poweroff or reboot)
})
END_REASONS = INFRASTRUCTURE_REASONS | USER_REASONS


def is_infrastructure(reason: str | None) -> bool:
    return reason in INFRASTRUCTURE_REASONS


class EventType(str, Enum):
    created = "created"
    paused = "paused"
    resumed = "resumed"
    updated = "updated"
    ended = "ended"


class SandboxEvent(BaseModel):
    """One lifecycle event. `id` is the control store's (monotonic per store, what a stream
    resumes from); `seq` the emitting edge's own (0 for events the apiserver made itself)."""

    id: int = Field(0, description="monotonic per control store; resume a stream after it (?after=ID)")
    type: EventType
    sandbox_id: str
    project: str
    node: str = ""
    reason: str | None = Field(None, description="ended: one word of the vocabulary (docs/events.md)")
    infrastructure: bool | None = Field(None, description="ended: True when the infrastructure ended it "
                                                          "(mask it, do not score it)")
    message: str | None = Field(None, description="the free-text why, as the sandbox's error says it")
    at: datetime
    details: dict[str, Any] = Field(default_factory=dict)
    seq: int = 0


class EdgeEvents(BaseModel):
    """An edge's events after a cursor, and the last seq it has written (a cursor past it
    means the edge's log was reset: start again from 0)."""

    events: list[SandboxEvent]
    last_seq: int


class EventList(BaseModel):
    events: list[SandboxEvent]
    last_id: int = Field(description="the id to pass as ?after= for the next page")


WEBHOOK_EVENTS = tuple(t.value for t in EventType)
URL_RE = re.compile(r"^https?://[^\s/?#\x00-\x1f]+[^\s\x00-\x1f]*$")
MAX_EVENT_ID = 2 ** 62      # a BIGINT on both engines


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=2048, pattern=URL_RE.pattern, description="http(s) URL the events are POSTed to")
    events: list[EventType] | None = Field(None, description="the event types to send; None: all")
    secret: str | None = Field(None, min_length=16, max_length=256, pattern=r"^[\x21-\x7e]+$",
                               description="the HMAC key deliveries are signed with; None: one is made "
                                           "and returned once")
    name: str = Field("", max_length=200, pattern=r"^[^\x00-\x1f]*$")
    project: str | None = Field(None, description="admin only: the project whose events it gets "
                                                  "(default: the key's own)")


class WebhookInfo(BaseModel):
    id: str
    project: str
    url: str
    name: str
    events: list[str] | None
    scheme: str = Field(description="'dsec' (HMAC-SHA256, dsec-signature) or 'e2b' (E2B's e2b-signature)")
    enabled: bool = True
    created_at: float
    secret: str | None = Field(None, description="set only in the answer to the create")


class WebhookList(BaseModel):
    webhooks: list[WebhookInfo]


class DeliveryInfo(BaseModel):
    id: str
    webhook_id: str
    event_id: int
    status: str = Field(description="pending, delivered or failed (given up after the retry window)")
    attempts: int
    next_at: float | None
    last_status: int | None = Field(None, description="the receiver's last HTTP status")
    last_error: str | None = None
    created_at: float
    delivered_at: float | None = None


class DeliveryList(BaseModel):
    deliveries: list[DeliveryInfo]
    pending: int
    delivered: int
    failed: int


class SandboxEnded(DsecError):
    """A request reached a sandbox that has ended; `reason` is its end reason (docs/events.md)
    and `infrastructure` whether the infrastructure ended it (a trainer masks those)."""

    @property
    def infrastructure(self) -> bool:
        return is_infrastructure(self.reason)


class InfrastructureFailure(SandboxEnded):
    """The sandbox was ended by the infrastructure (node_lost, oom_killed, host_pressure,
    preempted, agent_died, create_failed): not the task's fault."""


class EndedByUser(SandboxEnded):
    """The sandbox ended by the user's own doing (killed, ttl, lifetime, disk_quota, exited)."""


_TYPED: dict[tuple[type, bool], type[DsecError]] = {}


def ended_error(base: type[DsecError], reason: str, message: str, *, field: str | None = None,
                fix: str | None = None) -> DsecError:
    """The error `base` (by the wire's code) as the SandboxEnded subclass for `reason`: an
    `except SandboxFailed` and an `except InfrastructureFailure` both catch it."""
    infra = is_infrastructure(reason)
    key = (base, infra)
    cls: type[DsecError] | None = _TYPED.get(key)
    if cls is None:
        kind = InfrastructureFailure if infra else EndedByUser
        cls = _TYPED[key] = type(f"{kind.__name__}{base.__name__}", (kind, base), {"__module__": __name__})
    e: DsecError = cls(message, field=field, fix=fix)
    e.reason = reason
    return e
