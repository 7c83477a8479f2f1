"""Webhook delivery (docs/events.md): a worker per apiserver claims due deliveries from the
control store under a lease (replicas sharing a store do not send one twice while it lives; one
that dies mid-send lets it lapse: at-least-once), POSTs each signed, and records the outcome:
delivered on a 2xx, else retried after 1, 2, 4 ... s (at most DSEC_WEBHOOK_BACKOFF_MAX_S) until
DSEC_WEBHOOK_RETRY_FOR_S after it was queued, then failed. Redirects are not followed.

Signatures: 'dsec' webhooks get `dsec-signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`
with `dsec-timestamp`; webhooks made through the E2B mount get E2B's scheme and payload
(`e2b-signature`: unpadded base64 of SHA-256(secret + body), `e2b-signature-version: v1`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from dsec.apiserver.e2b.ids import to_e2b
from dsec.apiserver.events import pump
from dsec.store.events import Due, EventStore
from dsec.types import InvalidArgument, SandboxEvent

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext

log = logging.getLogger("dsec.apiserver.webhooks")

PARALLEL = 16          # deliveries in flight per apiserver
E2B_TYPES = {"created": "sandbox.lifecycle.created", "ended": "sandbox.lifecycle.killed",
             "paused": "sandbox.lifecycle.paused", "resumed": "sandbox.lifecycle.resumed",
             "updated": "sandbox.lifecycle.updated"}


# -- signing ---------------------------------------------------------------------------------
def dsec_signature(secret: str, timestamp: str, body: bytes) -> str:
    return "v1=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def e2b_signature(secret: str, body: bytes) -> str:
    return base64.b64encode(hashlib.sha256(secret.encode() + body).digest()).decode().rstrip("=")


def e2b_payload(ev: SandboxEvent) -> dict[str, Any]:
    """E2B's webhook payload (v2) for a dsec event; dsec's end reason rides in eventData."""
    data: dict[str, Any] = {"sandbox_metadata": ev.details.get("labels", {})}
    if ev.reason:
        data.update(reason=ev.reason, infrastructure=ev.infrastructure, message=ev.message)
    if "set_timeout" in ev.details:
        data["set_timeout"] = ev.details["set_timeout"]
    return {"version": "v2", "id": str(ev.id), "type": E2B_TYPES[ev.type.value], "eventData": data,
            "sandboxBuildId": "", "sandboxExecutionId": ev.sandbox_id, "sandboxId": to_e2b(ev.sandbox_id),
            "sandboxTeamId": ev.project, "sandboxTemplateId": ev.details.get("image", ""),
            "timestamp": ev.at.strftime("%Y-%m-%dT%H:%M:%SZ")}


def request_of(due: Due) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one attempt."""
    if due.webhook.scheme == "e2b":
        body = json.dumps(e2b_payload(due.event)).encode()
        return body, {"content-type": "application/json", "e2b-webhook-id": due.webhook.id,
                      "e2b-delivery-id": due.delivery_id, "e2b-signature-version": "v1",
                      "e2b-signature": e2b_signature(due.secret, body)}
    body = due.event.model_dump_json().encode()
    ts = str(int(time.time()))
    return body, {"content-type": "application/json", "dsec-webhook-id": due.webhook.id,
                  "dsec-delivery-id": due.delivery_id, "dsec-event-id": str(due.event.id), "dsec-timestamp": ts,
                  "dsec-signature": dsec_signature(due.secret, ts, body)}


# -- where a webhook may point ---------------------------------------------------------------
def _private(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


def check_target(url: str, allow_private: bool, field: str = "url") -> None:
    """A webhook URL must be http(s) with a host; unless `allow_private` (an admin's, or
    DSEC_WEBHOOK_PRIVATE_OK) every address its host resolves to must be public: the apiserver
    must not become a way into loopback services, the nodes' private network or a cloud's
    metadata address (checked again before each send: DNS may change)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"{field}: {url[:200]!r} is not an http(s) URL", field=field,
                              fix="give e.g. https://hooks.example.com/dsec")
    if allow_private:
        return
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                                   type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidArgument(f"{field}: host {parts.hostname!r} does not resolve: {e}", field=field,
                              fix="give a host name that resolves") from None
    bad = sorted({str(i[4][0]) for i in infos if _private(str(i[4][0]))})
    if bad:
        raise InvalidArgument(f"{field}: host {parts.hostname!r} is a private, loopback or link-local address "
                              f"({', '.join(bad)})", field=field,
                              fix="point the webhook at a public address (an admin key, or DSEC_WEBHOOK_PRIVATE_OK=1 "
                                  "on the server, allows private ones)")


# -- the worker -------------------------------------------------------------------------------
class WebhookWorker:
    def __init__(self, ctx: "ApiContext", store: EventStore):
        self.ctx = ctx
        self.store = store
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._http = httpx.AsyncClient(follow_redirects=False, trust_env=False)
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="dsec-webhooks")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _loop(self) -> None:
        sem = asyncio.Semaphore(PARALLEL)
        while True:
            try:
                dues = await asyncio.to_thread(self.store.claim_due, self._lease_s(), PARALLEL * 4)
                await asyncio.gather(*(self._guarded(sem, d) for d in dues))
            except Exception as e:
                dues = []
                log.warning("webhook delivery pass failed", extra={"error": f"{type(e).__name__}: {e}"})
            if not dues:   # idle: wake on a new event here, or look again in a second (other replicas' events)
                try:
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                except TimeoutError:
                    pass
                self._wake.clear()

    def _lease_s(self) -> float:
        return self.ctx.settings.events.webhook_timeout_s * 3 + 5

    async def _guarded(self, sem: asyncio.Semaphore, due: Due) -> None:
        async with sem:
            await self.send(due)

    async def send(self, due: Due) -> None:
        status: int | None = None
        try:
            allow = self.ctx.settings.events.webhook_private_ok or due.private_ok
            await asyncio.to_thread(check_target, due.webhook.url, allow)
            body, headers = request_of(due)
            assert self._http is not None
            r = await self._http.post(due.webhook.url, content=body, headers=headers,
                                      timeout=self.ctx.settings.events.webhook_timeout_s)
            status = r.status_code
            if 200 <= status < 300:
                await asyncio.to_thread(self.store.delivered, due.delivery_id, status)
                return
            error = f"the receiver answered HTTP {status}"
        except (httpx.HTTPError, OSError, InvalidArgument) as e:
            error = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
        conf = self.ctx.settings.events
        now = time.time()
        wait = min(2.0 ** due.attempts, conf.webhook_backoff_max_s)
        next_at = now + wait if now + wait - due.created_at <= conf.webhook_retry_for_s else None
        await asyncio.to_thread(self.store.failed_attempt, due.delivery_id, status, error, next_at)


def worker(ctx: "ApiContext") -> WebhookWorker:
    w = ctx.runtime.webhook_worker
    if w is None:
        p = pump(ctx)
        w = ctx.runtime.webhook_worker = WebhookWorker(ctx, p.store)
        p.on_new.append(w.wake)
    return w
