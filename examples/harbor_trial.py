"""A Harbor trial on a dsec sandbox: Harbor's own Trial runner, its scripted `oracle` agent (it
runs the task's solution/solve.sh: a toy policy, no model) and its verifier, with the
environment served by dsec (dsec.adapters.harbor.DsecEnvironment, loaded by import path).

    DSEC_URL=http://127.0.0.1:7620 DSEC_API_KEY=dsk_... python examples/harbor_trial.py [TASK_DIR]

Without TASK_DIR it writes a toy task: environment/Dockerfile FROM debian-python (built on the
dsec server with buildah), a solution that fixes a bug, a test.sh that writes the reward.
Prints one JSON line: {"reward": ..., "trial": ..., "exception": ...}. Needs `pip install
'.[harbor]'` in the checkout (Python >= 3.12, as Harbor).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial

TASK_TOML = """\
schema_version = "1.4"

[metadata]

[verifier]
timeout_sec = 300.0

[agent]
timeout_sec = 300.0

[environment]
build_timeout_sec = 900.0
"""

DOCKERFILE = """\
FROM debian-python
ENV TOY_GREETING="hello from harbor"
WORKDIR /app
COPY calc.py /app/calc.py
RUN python3 -c "import calc" && echo ready > /app/.built
"""

CALC = "def add(a, b):\n    return a - b   # the bug the policy fixes\n"

SOLVE = """\
#!/bin/bash
set -e
# the scripted policy: look, fix, check
cat calc.py
sed -i 's/return a - b.*/return a + b/' calc.py
python3 -c "import calc; assert calc.add(2, 3) == 5"
echo "$TOY_GREETING" > /app/policy.log
"""

TEST = """\
#!/bin/bash
cd /app
if python3 -c "import calc; assert calc.add(2, 3) == 5" && [ -f /app/.built ] \\
   && grep -q "hello from harbor" /app/policy.log; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def write_toy_task(root: Path) -> Path:
    task = root / "toy-calc"
    for rel, text in {"task.toml": TASK_TOML, "instruction.md": "Fix add() in /app/calc.py.\n",
                      "environment/Dockerfile": DOCKERFILE, "environment/calc.py": CALC,
                      "solution/solve.sh": SOLVE, "tests/test.sh": TEST}.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    return task


async def run_trial(task: Path, trials_dir: Path, env_kwargs: dict | None = None) -> dict:
    config = TrialConfig(
        task=TaskConfig(path=task),
        trials_dir=trials_dir,
        agent=AgentConfig(name="oracle"),
        # the two lines a user changes: Harbor's environment, by import path
        environment=EnvironmentConfig(import_path="dsec.adapters.harbor:DsecEnvironment",
                                      kwargs=env_kwargs or {}),
    )
    trial = await Trial.create(config)
    result = await trial.run()
    rewards = result.verifier_result.rewards if result.verifier_result else None
    return {"reward": (rewards or {}).get("reward"), "trial": result.trial_name,
            "exception": result.exception_info.model_dump(mode="json") if result.exception_info else None}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        task = Path(sys.argv[1]) if len(sys.argv) > 1 else write_toy_task(Path(tmp))
        out = asyncio.run(run_trial(task, Path(tmp) / "trials"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
