"""The stock E2B JavaScript SDKs (npm `e2b` and `@e2b/code-interpreter`, pinned in
js/package.json) under Debian's node, against a real dsec server: each js/*.mjs script (but the
helpers) is one test; it exits 0 and prints OK, or prints what failed. `scripts/install-extras.sh
tests` installs node and runs `npm ci` in js/."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import E2B_TEST_DOMAIN

JS = Path(__file__).parent / "js"
HELPERS = {"check.mjs"}
SCRIPTS = sorted(p.name for p in JS.glob("*.mjs") if p.name not in HELPERS)

if shutil.which("node") is None:
    pytest.skip("node is not installed (Debian's nodejs: scripts/install-extras.sh tests)",
                allow_module_level=True)
_node = tuple(int(x) for x in subprocess.run(["node", "-p", "process.versions.node"], capture_output=True,
                                              text=True).stdout.strip().split("."))
if _node < (20, 18, 1):
    pytest.skip(f"node {_node} is older than the e2b SDK's minimum (>= 20.18.1; Debian 12's is 18.20)",
                allow_module_level=True)
if not (JS / "node_modules" / "e2b").is_dir():
    pytest.skip(f"the npm packages are not installed: cd {JS} && npm ci", allow_module_level=True)


# scripts that need a built-in image besides the session's (built here, from the node's cache)
SCRIPT_IMAGES = {"code_interpreter.mjs": ("code-interpreter",)}


@pytest.mark.parametrize("script", SCRIPTS)
def test_js_sdk(script, e2b_env, server, images):
    from dsec.images.builtin import ensure_builtin
    for name in SCRIPT_IMAGES.get(script, ()):
        ensure_builtin(images, name)
    # DSEC_SERVER_URL / DSEC_E2B_DOMAIN: for scripts that reach the server by a sandbox's name
    env = {**os.environ, "NODE_NO_WARNINGS": "1", "DSEC_SERVER_URL": server.url,
           "DSEC_E2B_DOMAIN": E2B_TEST_DOMAIN, "DSEC_HTTPS_PORT": server.env.get("DSEC_HTTPS_PORT", ""),
           "DSEC_CA_FILE": str(server.paths.home / "tls" / "ca.pem")}
    r = subprocess.run(["node", script], cwd=JS, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), \
        f"node {script} exited {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
