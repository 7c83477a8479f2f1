"""The stages of one creation, timed into dsec_sandbox_create_seconds, and its outcome."""

from __future__ import annotations

import time

from dsec import metrics
from dsec.types import DsecError


class CreateTimer:
    def __init__(self, backend: str, project: str):
        self.backend, self.project = backend, project
        self.t0 = self.t = time.monotonic()
        self.refused = False
        self.warm = False

    def lap(self, stage: str) -> None:
        now = time.monotonic()
        metrics.CREATE_SECONDS.labels(self.backend, stage).observe(now - self.t)
        self.t = now

    def refuse(self, e: DsecError) -> None:
        """Admission said no: counted by what was short."""
        self.refused = True
        metrics.REFUSED.labels(metrics.refusal_reason(e)).inc()

    def done(self, outcome: str) -> None:
        metrics.CREATES.labels(self.project, self.backend, outcome).inc()
        if outcome == "ok":
            metrics.CREATE_SECONDS.labels(self.backend, "total").observe(time.monotonic() - self.t0)
