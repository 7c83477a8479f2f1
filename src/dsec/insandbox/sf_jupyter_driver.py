#!/usr/bin/python3
"""SandboxFusion's run_jupyter inside a `code-interpreter` sandbox (stdlib only; never imports dsec).

The apiserver (apiserver/sf_jupyter.py) writes this file into a fresh sandbox of the caller's
project, starts dsec-code-interpreter (port 49999, insandbox/code_interpreter_server.py) and runs

    python3 sf_jupyter_driver.py OUT.json   < {"cells", "cell_timeout", "total_timeout",
                                               "files": {path: base64}, "fetch_files": [path]}

It writes the files (relative to its cwd, the kernel's too), waits for the kernel, runs the cells
one by one in that kernel through the server's /execute (each bounded by the smaller of
cell_timeout and what is left of total_timeout: the server interrupts it), and writes OUT.json:

    {"status": "Finished"|"TimeLimitExceeded", "execution_time": s,
     "cells": [{"stdout", "stderr", "display": [MIME bundle], "error": [{"ename","evalue","traceback"}]}],
     "files": {path: base64}, "missing": [path]}

A cell that raises does not stop the next ones (the error is in its `error`); a timed-out cell
does. The clock starts once the kernel answers, so a slow kernel start is not the code's time.
"""

import base64
import http.client
import json
import os
import sys
import time

PORT = 49999
GRACE_S = 15.0            # the server's interrupt grace (10 s) and the answer's way back
# the code interpreter's result-line fields -> the MIME types Jupyter (and SandboxFusion) report
MIME = {"text": "text/plain", "html": "text/html", "markdown": "text/markdown", "svg": "image/svg+xml",
        "png": "image/png", "jpeg": "image/jpeg", "pdf": "application/pdf", "latex": "text/latex",
        "json": "application/json", "javascript": "application/javascript"}
FETCH_MAX = 16 << 20


def execute(code, timeout):
    """Run one cell; (its events, whether it ran out of time)."""
    conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=None if timeout is None else timeout + GRACE_S)
    body = {"code": code}
    if timeout is not None:
        body["timeout"] = max(timeout, 0.001)
    t0 = time.monotonic()
    conn.request("POST", "/execute", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError("code interpreter answered %d: %s" % (resp.status, resp.read()[:2000].decode(errors="replace")))
    events = [json.loads(line) for line in resp if line.strip()]
    conn.close()
    elapsed = time.monotonic() - t0
    timed_out = timeout is not None and elapsed >= timeout and any(
        e.get("type") == "error" and e.get("name") == "TimeoutError" for e in events)
    return events, timed_out


def cell_result(events):
    out = {"stdout": "", "stderr": "", "display": [], "error": []}
    for e in events:
        kind = e.get("type")
        if kind in ("stdout", "stderr"):
            out[kind] += e.get("text", "")
        elif kind == "result":
            bundle = {MIME[k]: v for k, v in e.items() if k in MIME}
            bundle.update(e.get("extra") or {})
            out["display"].append(bundle)
        elif kind == "error":
            out["error"].append({"ename": e.get("name", ""), "evalue": e.get("value", ""),
                                 "traceback": (e.get("traceback") or "").split("\n")})
    return out


def safe_path(rel):
    norm = os.path.normpath(rel)
    if os.path.isabs(rel) or norm == ".." or norm.startswith("../"):
        raise ValueError("file path %r must be relative, inside the working directory" % rel)
    return norm


def main():
    out_path = sys.argv[1]
    req = json.load(sys.stdin)
    for rel, b64 in (req.get("files") or {}).items():
        if b64 is None:
            continue
        path = safe_path(rel)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(b64))
    execute("", 120.0)                       # the kernel is up (prewarmed by the server's start)
    cell_timeout, total = float(req.get("cell_timeout") or 0), float(req["total_timeout"])
    t0 = time.monotonic()
    cells, status = [], "Finished"
    for code in req["cells"]:
        left = total - (time.monotonic() - t0)
        if left <= 0:
            status = "TimeLimitExceeded"
            break
        events, timed_out = execute(code, min(cell_timeout, left) if cell_timeout > 0 else left)
        cells.append(cell_result(events))
        if timed_out:
            status = "TimeLimitExceeded"
            break
    elapsed = time.monotonic() - t0
    files, missing, size = {}, [], 0
    for rel in req.get("fetch_files") or []:
        try:
            with open(safe_path(rel), "rb") as f:
                data = f.read(FETCH_MAX + 1 - size)
        except (OSError, ValueError):
            missing.append(rel)
            continue
        size += len(data)
        if size > FETCH_MAX:
            missing.append(rel)
            break
        files[rel] = base64.b64encode(data).decode()
    with open(out_path, "w") as f:
        json.dump({"status": status, "execution_time": elapsed, "cells": cells, "files": files,
                   "missing": missing}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
