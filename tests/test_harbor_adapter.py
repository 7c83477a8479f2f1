"""The Harbor adapter (dsec.adapters.harbor) driven by Harbor's own code against a real dsec
server: its EnvironmentFactory loading the environment by import path (exec with cwd, env,
user and timeout; file and directory uploads and downloads; stop), and a whole Harbor Trial
(its runner, the scripted `oracle` agent, the verifier) on a task whose environment/Dockerfile
is built on the server. Harbor needs Python >= 3.12: it runs in its own virtualenv
(.venv-harbor, made by scripts/install-extras.sh tests where a python3.12 exists, or $DSEC_HARBOR_PYTHON)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARBOR_PY = Path(os.environ.get("DSEC_HARBOR_PYTHON", str(ROOT / ".venv-harbor" / "bin" / "python")))


def _harbor_ok() -> str | None:
    if not HARBOR_PY.exists():
        return f"no Python with Harbor at {HARBOR_PY} (Harbor needs Python >= 3.12: scripts/install-extras.sh tests makes .venv-harbor)"
    r = subprocess.run([str(HARBOR_PY), "-c", "import harbor, dsec.adapters.harbor"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"{HARBOR_PY} cannot import harbor and dsec.adapters.harbor: {r.stderr[-300:]}"
    return None


pytestmark = [pytest.mark.skipif(_harbor_ok() is not None, reason=_harbor_ok() or ""),
              pytest.mark.skipif(shutil.which("buildah") is None,
                                 reason="buildah is not installed (apt-get install buildah; scripts/install-extras.sh builds)")]


def _run(server, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSEC_URL": server.url, "DSEC_API_KEY": server.key, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([str(HARBOR_PY), *args], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=str(ROOT))


async def _sandboxes(client) -> list[str]:
    return [s.id for s in await client.list() if s.state.value not in ("stopped", "failed")]


async def test_environment_interface_through_harbors_factory(server, client):
    before = set(await _sandboxes(client))
    r = _run(server, str(ROOT / "tests" / "harbor_env_driver.py"), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["type"] == "dsec" and "timed out after 1 seconds" in seen["timeout"]
    # stop() left no sandbox running (others' may have ended meanwhile: only new ones count)
    assert set(await _sandboxes(client)) <= before
    assert seen["sandbox_id"] not in set(await _sandboxes(client))


async def test_harbor_trial_with_oracle_agent_and_dockerfile(server, client, tmp_path):
    """Harbor's Trial runner end to end: the Dockerfile is built on dsec (once per content
    hash), the oracle's solve.sh fixes the bug, the verifier's test.sh writes reward 1."""
    before = set(await _sandboxes(client))
    r = _run(server, str(ROOT / "examples" / "harbor_trial.py"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["exception"] is None, out
    assert out["reward"] == 1, out
    assert any(i.name.startswith("harbor-toy-calc-") for i in await client.images())
    assert set(await _sandboxes(client)) <= before             # the trial left no sandbox running


async def test_harbor_cli_trial_with_the_documented_flags(server, client, tmp_path):
    """docs/adapters.md's command line (issue 23: it said `--ek`, which `harbor trial start`
    does not take, and the deprecated `--environment-import-path`): `-e IMPORT_PATH` and
    `--environment-kwarg k=v`, here with the kwargs given on the command line, not the env."""
    r = _run(server, "-c", "import sys; sys.path.insert(0, 'examples'); from harbor_trial import write_toy_task; "
             f"from pathlib import Path; print(write_toy_task(Path({str(tmp_path)!r})))")
    assert r.returncode == 0, r.stderr
    task = r.stdout.strip()
    before = set(await _sandboxes(client))
    harbor = str(HARBOR_PY.parent / "harbor")
    r = subprocess.run([harbor, "trial", "start", "-p", task, "-a", "oracle", "-e", "dsec.adapters.harbor:DsecEnvironment",
                        "--environment-kwarg", f"url={server.url}", "--environment-kwarg", f"api_key={server.key}",
                        "--trials-dir", str(tmp_path / "trials"), "--trial-name", "cli"],
                       capture_output=True, text=True, timeout=900, cwd=str(tmp_path),
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "trials" / "cli" / "result.json").read_text())
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": 1}
    assert "deprecated" not in (r.stdout + r.stderr).lower()
    assert set(await _sandboxes(client)) <= before


def test_adapter_not_importable_without_harbor():
    """The core never imports the adapter; importing it without harbor names the extra."""
    r = subprocess.run([sys.executable, "-c", "import dsec, dsec.sdk; import sys; "
                        "assert 'dsec.adapters.harbor' not in sys.modules"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
