"""Schemathesis against the live server's /openapi.json (issue item 14): generated requests,
valid and invalid, to every operation, with the admin key. No answer may be a 5xx, and every
answer must conform to the schema: a documented status, content type and body (errors are the
ErrorBody model, `{"error": {code, message, field, fix}}`).

Bounded: a fixed number of examples per operation (the same ones each run, for a stable CI;
DSEC_SCHEMA_RANDOM=1 draws new ones), no shrinking, no deadline, one total time budget of
2.5 min (about 1 min used on 2 cores). Half the examples of a sandbox's operations use a real
running sandbox (else every one would stop at 404); commands and programs get at most 5 s.
Left out:

- POST /v1/fncall/batch: one example may be 1,024 programs (tests/test_fncall.py covers it);
- POST /run_jupyter: every example starts a sandbox and a Jupyter kernel, seconds each, the whole
  budget (tests/test_sandboxfusion_parity.py covers it);
- DELETE /v1/sandboxes/{id}, POST .../pack_diff and POST .../fork with the real sandbox: the first
  stops it, the second builds a new layer per example, the third starts up to 64 sandboxes per
  example (random ids still go to them; tests/test_fork.py covers fork).
"""

from __future__ import annotations

import os
import time

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

EXAMPLES = 20              # per operation and generation mode (valid, invalid)
RANDOM = os.environ.get("DSEC_SCHEMA_RANDOM") == "1"   # 1: new examples each run (else the same ones)
BUDGET_S = 150.0           # all operations together
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
SKIPPED = {("POST", "/v1/fncall/batch"), ("POST", "/run_jupyter")}
NOT_WITH_REAL_SANDBOX = {("DELETE", "/v1/sandboxes/{sandbox_id}"), ("POST", "/v1/sandboxes/{sandbox_id}/pack_diff"),
                         ("POST", "/v1/sandboxes/{sandbox_id}/fork")}
# operations that run a command or program, and the body field that bounds its time
TIMEOUTS = {"/v1/sandboxes/{sandbox_id}/exec": "timeout_s", "/v1/sandboxes/{sandbox_id}/exec/stream": "timeout_s",
            "/v1/fncall": "timeout_s", "/run_code": "run_timeout"}
SHORT_S = 5.0
WEBHOOK_SINK = "http://127.0.0.1:9/schemathesis"   # webhooks the test registers: removed at its end


def _bound(path: str, case) -> None:
    """Commands and programs run at most a few seconds, whatever timeout was generated (an
    absent one would mean the default, 300 s)."""
    if path == "/v1/events" and case.query is not None:
        case.query["follow"] = False      # a stream runs until its client leaves (tests/test_events.py)
    if path == "/v1/webhooks" and isinstance(case.body, dict) and str(case.body.get("url", "")).startswith("http"):
        case.body["url"] = WEBHOOK_SINK   # the admin may register any URL: a closed local port, not a random host
    field = TIMEOUTS.get(path)
    if field and isinstance(case.body, dict):
        v = case.body.get(field, SHORT_S)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            case.body[field] = min(v, SHORT_S)


def test_api_conforms_to_its_schema(server):
    # one real sandbox for the sandbox routes (created over plain HTTP: this test is sync)
    headers = {"Authorization": f"Bearer {server.key}"}
    r = httpx.post(server.url + "/v1/sandboxes", json={"image": "busybox"}, headers=headers, timeout=60)
    assert r.status_code == 201, r.text
    real_id = r.json()["id"]
    hooks_before = {h["id"] for h in httpx.get(f"{server.url}/v1/webhooks", headers=headers,
                                                timeout=60).json()["webhooks"]}
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    deadline = time.monotonic() + BUDGET_S
    ran: dict[str, int] = {}
    created: list[str] = []
    failures: list[str] = []
    try:
        for result in schema.get_all_operations():
            op = result.ok()
            key = (op.method.upper(), op.path)
            if key in SKIPPED:
                continue
            strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))
            real_ok = "{sandbox_id}" in op.path and key not in NOT_WITH_REAL_SANDBOX

            @settings(max_examples=2 * EXAMPLES, deadline=None, database=None, derandomize=not RANDOM,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=strategy, real=st.booleans())
            def run(case, real) -> None:
                if time.monotonic() > deadline:
                    return
                if real and real_ok:
                    case.path_parameters = {**(case.path_parameters or {}), "sandbox_id": real_id}
                _bound(op.path, case)
                resp = case.call_and_validate(base_url=server.url, headers=headers, checks=CHECKS, timeout=60)
                if key == ("POST", "/v1/sandboxes") and resp.status_code == 201:
                    created.append(resp.json()["id"])
                ran[f"{key[0]} {key[1]}"] = ran.get(f"{key[0]} {key[1]}", 0) + 1

            try:
                run()
            except (Exception, BaseExceptionGroup) as e:   # schemathesis' FailureGroup; every operation
                # gets its turn and all failures are reported together
                failures.append(f"{key[0]} {key[1]}: {str(e)[:3000]}")
    finally:
        for sid in [real_id, *created]:
            httpx.delete(f"{server.url}/v1/sandboxes/{sid}", headers=headers, timeout=60)
        hooks = httpx.get(f"{server.url}/v1/webhooks", headers=headers, timeout=60).json()["webhooks"]
        for h in hooks:
            if h["id"] not in hooks_before:
                httpx.delete(f"{server.url}/v1/webhooks/{h['id']}", headers=headers, timeout=60)
    assert not failures, "\n\n".join(failures)
    assert time.monotonic() <= deadline + 60, "over the time budget"
    print(f"schemathesis: {sum(ran.values())} requests to {len(ran)} operations")
    assert len(ran) >= 25, sorted(ran)
