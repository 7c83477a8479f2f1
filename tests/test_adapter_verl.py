"""The verl tool adapter (dsec.adapters.verl_tool) driven by verl's own code against a real dsec
server: verl's tool registry loads the tool from a tool-config YAML and verl's ToolAgentLoop runs
a three-turn trajectory (scripted policy, byte-level tokenizer: no weights) whose tool calls run
in one dsec sandbox. verl pulls torch (GBs): it lives in its own virtualenv (.venv-verl, made by
scripts/install-extras.sh tests, or $DSEC_VERL_PYTHON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERL_PY = Path(os.environ.get("DSEC_VERL_PYTHON", str(ROOT / ".venv-verl" / "bin" / "python")))


def _verl_missing() -> str | None:
    if not VERL_PY.exists():
        return f"no Python with verl at {VERL_PY} (scripts/install-extras.sh tests makes .venv-verl: pip install -e '.[verl]')"
    r = subprocess.run([str(VERL_PY), "-c", "import verl.tools.base_tool, dsec.adapters.verl_tool"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return f"{VERL_PY} cannot import verl and dsec.adapters.verl_tool: {r.stderr[-300:]}"
    return None


pytestmark = pytest.mark.skipif(_verl_missing() is not None, reason=_verl_missing() or "")


async def _live(client) -> set[str]:
    return {s.id for s in await client.list() if s.state.value not in ("stopped", "failed")}


async def test_verl_tool_agent_loop_runs_its_tool_calls_in_one_sandbox(server, client):
    before = await _live(client)
    env = {**os.environ, "DSEC_URL": server.url, "DSEC_API_KEY": server.key, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([str(VERL_PY), str(ROOT / "examples" / "verl_tool_episode.py")], capture_output=True,
                       text=True, env=env, timeout=600, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # turn 1's tool call saw the create_kwargs file; turn 2's saw turn 1's file: one sandbox
    assert "multiply six by seven" in out["response"], out
    assert "answer is 42" in out["response"], out
    assert "The answer is 42." in out["response"], out
    assert out["num_turns"] >= 4 and out["reward"] == 1.0, out
    assert len(out["sandbox_ids"]) == 1, out          # both tool calls in one sandbox
    info = (await client.get(out["sandbox_ids"][0])).info
    assert info.labels.get("verl-tool") == "run_code" and info.state.value in ("stopped", "failed")
    assert await _live(client) <= before         # close() left no sandbox running


def test_adapter_not_imported_by_the_core():
    r = subprocess.run([sys.executable, "-c", "import dsec, dsec.sdk, sys; "
                        "assert 'dsec.adapters.verl_tool' not in sys.modules and 'verl' not in sys.modules"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
