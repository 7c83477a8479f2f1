"""The stages of one creation, timed into dsec_sandbox_create_seconds, and its outcome."""

from __future__ import annotations

import time

from dsec import metrics, tracing
from dsec.types import DsecError


# the stages' span names: prepare resolves the image (and volumes), start is the backend's
# create (runtime, mounts, network) after slot, the wait for one of the node's start slots
# (DSEC_CREATE_PARALLEL), agent waits for the in-sandbox agent to answer
STAGE_SPANS = {"prepare": "dsec.create.image", "admission": "dsec.create.admission",
               "slot": "dsec.create.slot_wait", "start": "dsec.create.start", "agent": "dsec.create.agent_ready"}


class CreateTimer:
    def __init__(self, backend: str, project: str):
        self.backend, self.project = backend, project
        self.t0 = self.t = time.monotonic()
        self.t_ns = time.time_ns()      # wall clock of the last lap (spans are in wall-clock time)
        self.refused = False
        self.warm = False

    def lap(self, stage: str) -> None:
        now = time.monotonic()
        metrics.CREATE_SECONDS.labels(self.backend, stage).observe(now - self.t)
        if tracing.on():     # the stage as a child span of dsec.edge.create (docs/traces.md)
            end_ns = time.time_ns()
            tracing.past_span(STAGE_SPANS.get(stage, f"dsec.create.{stage}"), self.t_ns, end_ns,
                              {"dsec.stage": stage, "dsec.backend": self.backend})
            self.t_ns = end_ns
        self.t = now

    def refuse(self, e: DsecError) -> None:
        """Admission said no: counted by what was short."""
        self.refused = True
        metrics.REFUSED.labels(metrics.refusal_reason(e)).inc()

    def done(self, outcome: str) -> None:
        metrics.CREATES.labels(self.project, self.backend, outcome).inc()
        if outcome == "ok":
            metrics.CREATE_SECONDS.labels(self.backend, "total").observe(time.monotonic() - self.t0)
