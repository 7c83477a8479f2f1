"""SkyRL-gym on dsec: tool groups and a multi-turn code environment whose code runs in a dsec
sandbox instead of on the trainer's host.

SkyRL-gym's own code tools run model-written code with `subprocess.run(["python", "-c", code])`
on the machine that runs the environment. Here the same tools run it in one dsec container
sandbox per episode (created at `init`, stopped at `close`), so code of one episode sees its own
earlier files and nothing else:

    import skyrl_gym
    import dsec.adapters.skyrl_gym                    # registers "dsec-code"
    env = skyrl_gym.make("dsec-code", env_config={"image": "debian-python"},
                         extras={"reward_spec": {"test_command": "python3 /work/test_sol.py"},
                                 "files": {"/work/test_sol.py": TEST}, "max_turns": 6})

`DsecToolGroup(sandbox)` is the drop-in for `PythonCodeExecutorToolGroup()` in an environment
of one's own (same tool name `python`, same result strings), plus `bash` (a persistent shell
session: cwd and exported variables carry over between calls).

Actions use SkyRL-gym's searchcode format: `<tool><python>code</python></tool>` or
`<tool><bash>command</bash></tool>`; `<solution>...</solution>` (or the last turn) ends the
episode. Reward: with `reward_spec.test_command`, 1.0 when that command exits 0 in the sandbox
at the end, else 0.0; with `reward_spec.ground_truth`, 1.0 when the solution text equals it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType
from skyrl_gym.envs.registration import register, registry
from skyrl_gym.tools.core import ToolGroup, tool

from dsec.sdk.sync import SyncClient, SyncSandbox
from dsec.types import ContainerArgs, DsecError

ENV_ID = "dsec-code"
SESSION = "skyrl"
_ACTION = re.compile(r"<tool>\s*<(python|bash)>(.*?)</\1>\s*</tool>", re.DOTALL)
_SOLUTION = re.compile(r"<solution>(.*?)</solution>", re.DOTALL)
MAX_ARG_BYTES = 128 * 1024 - 1   # MAX_ARG_STRLEN less the NUL: the largest -c argument

_clients: dict[tuple[str | None, str | None], SyncClient] = {}
_clients_lock = threading.Lock()


def client_for(url: str | None = None, api_key: str | None = None) -> SyncClient:
    """One blocking SDK client per dsec URL and key, shared by every environment of the process
    (a trainer makes thousands of envs; each would otherwise hold its own connection pool)."""
    with _clients_lock:
        c = _clients.get((url, api_key))
        if c is None:
            c = _clients[(url, api_key)] = SyncClient(url, api_key)
        return c


class DsecToolGroup(ToolGroup):
    """`python` and `bash` tools that run in a dsec sandbox (SkyRL-gym ToolGroup)."""

    def __init__(self, sandbox: SyncSandbox, timeout_s: float = 10.0, name: str = "DsecToolGroup"):
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        super().__init__(name=name)

    @tool
    def python(self, code: str) -> str:
        # PythonCodeExecutorToolGroup's contract: stdout stripped, or the error text with stderr.
        # The code is python's -c argument there too, so tracebacks say "<string>" and sys.argv is
        # ['-c']; it travels as stdin (no shell quoting). Past Linux's 128 KiB per argument (where
        # SkyRL's own subprocess fails) it runs as `python3 -` from stdin instead.
        cmd = 'exec python3 -c "$(cat)"' if len(code.encode()) < MAX_ARG_BYTES else "exec python3 -"
        r = self.sandbox.run(cmd, stdin=code, timeout_s=self.timeout_s)
        if r.timed_out:
            return f"Error executing Python code: Execution timed out after {self.timeout_s} seconds."
        if r.stderr:
            return f"Error executing Python code: {r.stderr.strip()}"
        return r.stdout.strip()

    @tool
    def bash(self, command: str) -> str:
        r = self.sandbox.run(f"{command} 2>&1", session=SESSION, timeout_s=self.timeout_s)
        if r.timed_out:
            return f"Error: command timed out after {self.timeout_s} seconds (the shell was restarted)."
        out = r.stdout.rstrip("\n")
        return out if r.exit_code == 0 else f"{out}\n[exit code {r.exit_code}]".lstrip("\n")


class DsecCodeEnv(BaseTextEnv):
    """A multi-turn code environment on one dsec sandbox per episode.

    env_config: image (default debian-python), url, api_key, cpu_cores, memory_mb, tool_timeout_s,
    ttl_idle_s. extras: reward_spec ({test_command} or {ground_truth}), max_turns (default 4),
    files ({path: text} written before the first turn).
    """

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None):
        super().__init__()
        cfg = env_config if env_config is not None else {}
        extras = extras or {}
        self.reward_spec: Mapping[str, Any] = extras.get("reward_spec") or {}
        if not ("test_command" in self.reward_spec or "ground_truth" in self.reward_spec):
            raise ValueError("extras.reward_spec needs test_command (exit 0 = reward 1) or ground_truth")
        self.max_turns = int(extras.get("max_turns", 4))
        self.files: Mapping[str, str] = extras.get("files") or {}
        self.tool_timeout_s = float(cfg.get("tool_timeout_s", 10.0))
        self._client = client_for(cfg.get("url"), cfg.get("api_key"))
        self._args = ContainerArgs(image=cfg.get("image", "debian-python"),
                                   cpu_cores=float(cfg.get("cpu_cores", 1.0)),
                                   memory_mb=int(cfg.get("memory_mb", 512)),
                                   ttl_idle_s=int(cfg.get("ttl_idle_s", 600)),
                                   labels={"skyrl-gym": ENV_ID})
        self.sandbox: SyncSandbox | None = None
        self.chat_history: ConversationType = []

    # -- SkyRL-gym's Env API

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        self.sandbox = self._client.create_container(self._args)
        for path, text in self.files.items():
            self.sandbox.files.write(path, text.encode(), mkdirs=True)
        self.init_tool_groups([DsecToolGroup(self.sandbox, self.tool_timeout_s)])
        self.chat_history = list(prompt)
        return prompt, {"sandbox_id": self.sandbox.id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        self.chat_history.append({"role": "assistant", "content": action})
        solution = _SOLUTION.search(action)
        if solution is not None or self.turns >= self.max_turns:
            reward = self._reward(solution.group(1).strip() if solution else None)
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})
        found = _ACTION.search(action)
        if found is None:
            observation = "No <tool><python>...</python></tool> or <tool><bash>...</bash></tool> block found."
            info: dict[str, Any] = {"tool_name": None}
        else:
            name, arg = found.group(1), found.group(2).strip()
            try:
                observation = self._execute_tool("DsecToolGroup", name, [arg])
            except DsecError as e:       # the sandbox refused or failed: the model sees why
                observation = f"Error: {e}"
            info = {"tool_name": name, "tool_input": arg}
        msg = {"role": "user", "content": observation}
        self.chat_history.append(msg)
        return BaseTextEnvStepOutput(observations=[msg], reward=0.0, done=False, metadata=info)

    def close(self) -> None:
        sb, self.sandbox = self.sandbox, None
        if sb is not None:
            sb.stop()

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns}

    # -- reward

    def _reward(self, solution: str | None) -> float:
        if "test_command" in self.reward_spec:
            assert self.sandbox is not None, "init() first"
            r = self.sandbox.run(str(self.reward_spec["test_command"]), session=SESSION,
                                 timeout_s=float(self.reward_spec.get("timeout_s", 60)))
            return 1.0 if r.exit_code == 0 and not r.timed_out else 0.0
        return 1.0 if solution is not None and solution == str(self.reward_spec["ground_truth"]).strip() else 0.0


def register_envs() -> None:
    """Register "dsec-code" with skyrl_gym (idempotent; done on import)."""
    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point=f"{__name__}:DsecCodeEnv")


register_envs()
