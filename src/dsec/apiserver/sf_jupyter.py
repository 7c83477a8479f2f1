"""SandboxFusion-compatible `POST /run_jupyter`: cells run one after another in one Jupyter kernel.

Each request gets a fresh sandbox of the built-in `code-interpreter` image (ipykernel +
dsec-code-interpreter, the E2B drop-in's kernel server) in the CALLER's project: its policy and
quota bound it, its own container isolates it from every other call and tenant, it has no egress
(the default network policy), and it is stopped when the answer is ready. Inside, the driver
(insandbox/sf_jupyter_driver.py) writes the files, runs the cells through the kernel server with
the per-cell and total timeouts, and collects fetch_files.

Wire shapes are SandboxFusion's (RunJupyterRequest -> RunJupyterResponse: status
Success/Failed/SandboxError, driver, cells[{stdout, stderr, display, error}], files). One
difference: on a timeout SandboxFusion answers no cells; dsec answers the cells that ran.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from dsec.apiserver import control
from dsec.iam import Principal
from dsec.insandbox import source
from dsec.types import (FNCALL_MAX_TIMEOUT_S, ContainerArgs, DsecError, ExecRequest, InvalidArgument,
                        SandboxFailed)

if TYPE_CHECKING:
    from dsec.apiserver.context import ApiContext

log = logging.getLogger("dsec.apiserver.sandboxfusion")

IMAGE = "code-interpreter"
DRIVER = "/tmp/.sf-jupyter-driver.py"
RESULT = "/tmp/.sf-jupyter-result.json"
START = "/usr/local/bin/dsec-code-interpreter --daemon --cwd /work"
SLACK_S = 60.0              # kernel start and the driver's own work, beyond total_timeout
RESULT_MAX = 64 << 20
_stopping: set[asyncio.Task[None]] = set()      # stops in flight (a task nobody holds may be collected)


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: Optional[float] = None
    return_code: Optional[int] = None
    stdout: Optional[str] = None
    stderr: Optional[str] = None


class RunJupyterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")     # as SandboxFusion (and run_code here)

    cells: list[str] = Field(max_length=1024, description="code blocks run in order in one kernel")
    cell_timeout: float = Field(0, ge=0, le=FNCALL_MAX_TIMEOUT_S, description="per cell, seconds; 0: none")
    total_timeout: float = Field(45, gt=0, le=FNCALL_MAX_TIMEOUT_S, description="all cells, seconds")
    kernel: Literal["python3"] = "python3"
    files: dict[str, Optional[str]] = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: list[str] = Field(default_factory=list, max_length=64)


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    error: list[dict[str, Any]]


class RunJupyterResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    driver: Optional[CommandRunResult] = None
    cells: list[CellRunResult] = []
    executor_pod_name: Optional[str] = None
    files: dict[str, str] = {}


def _check_files(req: RunJupyterRequest) -> None:
    for p in [*req.files, *req.fetch_files]:
        parts = p.replace("\\", "/").split("/")
        if not p or p.startswith("/") or ".." in parts or "\0" in p:
            raise InvalidArgument(f"file path {p!r} must be relative, inside the working directory",
                                  field="files" if p in req.files else "fetch_files",
                                  fix="use paths like 'data/input.csv'")


async def run_jupyter(ctx: "ApiContext", who: Principal, req: RunJupyterRequest) -> RunJupyterResponse:
    _check_files(req)
    t0 = time.monotonic()
    budget = req.total_timeout + SLACK_S
    args = ContainerArgs(image=IMAGE, cpu_cores=1.0, memory_mb=1024, ttl_idle_s=int(budget) + 60,
                         lifetime_s=int(budget) + 120, labels={"dsec-sandboxfusion": "run_jupyter"})
    info = await control.create_sandbox(ctx, who, args)
    edge = ctx.edge_for(info.id)
    try:
        await edge.write_file(info.id, DRIVER, source("sf_jupyter_driver.py").read_bytes(), mode=0o644)
        payload = {"cells": req.cells, "cell_timeout": req.cell_timeout, "total_timeout": req.total_timeout,
                   "files": req.files, "fetch_files": req.fetch_files}
        r = await edge.run(info.id, ExecRequest(cmd=f"{START} && exec python3 {DRIVER} {RESULT}",
                                                stdin=json.dumps(payload), timeout_s=budget))
        if r.exit_code != 0:
            raise SandboxFailed(f"the jupyter driver failed (exit {r.exit_code}"
                                f"{', timed out' if r.timed_out else ''}): {r.stderr[-2000:]}")
        out = json.loads(await edge.read_file(info.id, RESULT, maxlen=RESULT_MAX))
    finally:
        # the answer never waits on the stop, and a cancelled request still stops its sandbox
        task = asyncio.create_task(_stop(ctx, info.id))
        _stopping.add(task)
        task.add_done_callback(_stopping.discard)
    finished = out["status"] == "Finished"
    log.info("run_jupyter", extra={"path": "/run_jupyter", "project": who.project_id, "sandbox": info.id,
                                   "cells": len(req.cells), "status": out["status"],
                                   "total_s": round(time.monotonic() - t0, 3)})
    return RunJupyterResponse(
        status="Success" if finished else "Failed",
        message="" if finished else f"the cells ran past their time limit (cell_timeout {req.cell_timeout:g}s, "
                                    f"total_timeout {req.total_timeout:g}s)",
        driver=CommandRunResult(status=out["status"], execution_time=out["execution_time"], return_code=0,
                                stdout="", stderr=""),
        cells=[CellRunResult(**c) for c in out["cells"]], executor_pod_name=info.id, files=out["files"])


async def _stop(ctx: "ApiContext", sandbox_id: str) -> None:
    try:
        await control.stop_sandbox(ctx, ctx.edge_for(sandbox_id), sandbox_id)
    except DsecError as e:
        log.warning("run_jupyter: stopping the sandbox failed", extra={"sandbox": sandbox_id, "error": e.message})


def sandbox_error(e: DsecError, pod_name: str | None = None) -> RunJupyterResponse:
    return RunJupyterResponse(status="SandboxError", message=e.message + (f" (fix: {e.fix})" if e.fix else ""),
                              executor_pod_name=pod_name)
