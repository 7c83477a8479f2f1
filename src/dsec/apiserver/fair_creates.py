"""Fair creates between projects: a per-project rate limit, then a round-robin queue in front of
quota and placement, per apiserver (each replica of a cluster has its own).

Rate: a token bucket per project, `max_creates_per_s` / `max_create_burst` of its effective
policy, else DSEC_CREATE_RATE / DSEC_CREATE_BURST (0: no limit). A create beyond it is refused
at once: 429 with Retry-After saying when the next token comes.

Queue: at most DSEC_CREATE_CONCURRENCY creates are placed at once. The others wait in one
queue per project, and a freed slot goes to the next project in turn (round-robin between the
projects that have creates waiting), so one project's burst of 10,000 delays another's 10 by
one turn each, not by 10,000 creates. A project with DSEC_CREATE_QUEUE_MAX creates waiting has
its next one refused (429).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from dsec import metrics
from dsec.iam.policy import SandboxPolicy
from dsec.types import CapacityExceeded

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext

MAX_BUCKETS = 100_000       # projects remembered; full buckets are forgotten first


class CreatesLimited(CapacityExceeded):
    """A project's creates beyond its rate or queue: retry after `retry_after_s`."""

    def __init__(self, message: str, *, field: str, fix: str, retry_after_s: int):
        super().__init__(message, field=field, fix=fix)
        self.retry_after_s = retry_after_s


class TokenBucket:
    def __init__(self, rate: float, burst: int, now: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), now

    def take(self, now: float) -> float:
        """0 if a token was taken; else the seconds until one is there."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class FairCreates:
    """One per apiserver (ApiRuntime.create_gate); used on its event loop only."""

    def __init__(self, concurrency: int, queue_max: int, rate: float = 0.0, burst: int = 0):
        self.concurrency = max(1, concurrency)
        self.queue_max = queue_max
        self.rate, self.burst = rate, burst          # the default of projects without a policy
        self.running = 0
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()   # in turn order
        self._buckets: dict[str, TokenBucket] = {}

    def waiting(self, project: str | None = None) -> int:
        if project is not None:
            return len(self._waiting.get(project, ()))
        return sum(len(q) for q in self._waiting.values())

    # -- rate ----------------------------------------------------------------------------
    def admit(self, project: str, policy: SandboxPolicy) -> None:
        """Take one of the project's create tokens, or raise CreatesLimited (429)."""
        rate = policy.max_creates_per_s if policy.max_creates_per_s is not None else self.rate
        if not rate:
            return
        burst = policy.max_create_burst or self.burst or max(1, math.ceil(rate))
        now = time.monotonic()
        b = self._buckets.get(project)
        if b is None or (b.rate, b.burst) != (rate, burst):
            if len(self._buckets) >= MAX_BUCKETS:
                self._forget_full(now)
            b = self._buckets[project] = TokenBucket(rate, burst, now)
        wait = b.take(now)
        if wait:
            metrics.PLACEMENTS.labels("rate_limited").inc()
            retry = max(1, math.ceil(wait))
            raise CreatesLimited(
                f"project {project} creates at most {rate:g} sandboxes/s (burst {burst}) through this "
                f"apiserver", field="max_creates_per_s",
                fix=f"retry after {retry} s (Retry-After), spread creates out, or ask an admin of a parent "
                    f"project to raise max_creates_per_s / max_create_burst (PUT /v1/projects/{project}/policy)",
                retry_after_s=retry)

    def _forget_full(self, now: float) -> None:
        for p, b in list(self._buckets.items()):
            if b.tokens + (now - b.at) * b.rate >= b.burst:
                del self._buckets[p]
        while len(self._buckets) >= MAX_BUCKETS:
            self._buckets.pop(next(iter(self._buckets)))

    # -- queue ---------------------------------------------------------------------------
    @asynccontextmanager
    async def turn(self, project: str) -> AsyncIterator[None]:
        """Hold one of the create slots while the body runs; wait for the project's turn first
        if all are taken (or others wait)."""
        if self.running < self.concurrency and not self._waiting:
            self.running += 1
        else:
            await self._wait(project)
        try:
            yield
        finally:
            self._release()

    async def _wait(self, project: str) -> None:
        q = self._waiting.get(project)
        if q is not None and len(q) >= self.queue_max:
            metrics.PLACEMENTS.labels("queue_full").inc()
            raise CreatesLimited(f"project {project} has {len(q)} creates waiting at this apiserver",
                                 field="sandboxes", fix="retry after 1 s (Retry-After), once some have been "
                                                        "placed; send fewer creates at once",
                                 retry_after_s=1)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if q is None:
            q = self._waiting[project] = deque()     # a project new to the rotation joins at its end
        q.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()                      # the slot came just as the caller left: pass it on
            else:
                self._drop(project, fut)
            raise

    def _drop(self, project: str, fut: asyncio.Future[None]) -> None:
        q = self._waiting.get(project)
        if q is None:
            return
        try:
            q.remove(fut)
        except ValueError:
            pass
        if not q:
            del self._waiting[project]

    def _release(self) -> None:
        """A slot is free: to the first waiter of the next project in turn, which then goes to
        the end of the rotation; with nobody waiting, the slot is free."""
        while self._waiting:
            project, q = self._waiting.popitem(last=False)
            fut = q.popleft()
            if q:
                self._waiting[project] = q
            if not fut.done():
                fut.set_result(None)                 # the slot passes on: running stays the same
                return
        self.running -= 1


def create_gate(ctx: ApiContext) -> FairCreates:
    """The apiserver's FairCreates, made on first use from its settings."""
    if ctx.runtime.create_gate is None:
        s = ctx.settings.server
        ctx.runtime.create_gate = FairCreates(s.create_concurrency, s.create_queue_max,
                                              s.create_rate_per_s, s.create_burst)
    gate: FairCreates = ctx.runtime.create_gate
    return gate
