"""verl on dsec: a multi-turn agent-loop tool whose code runs in a dsec sandbox.

verl's ToolAgentLoop creates, executes and releases a tool instance around EVERY tool call, so a
tool that keeps state per instance forgets it between the turns of one trajectory. This tool
keeps one dsec container sandbox per trajectory instead (keyed by the agent loop's request id,
which verl passes to execute() with the agent data): the code of turn 3 sees the files turn 1
wrote, and nothing of any other trajectory. A trajectory's sandbox ends when its idle TTL runs
out (verl tells tools nothing when a trajectory ends), or at once with `end_trajectory()` or
`close()`.

The two lines a user changes: in the tool config YAML that verl's
`actor_rollout_ref.rollout.multi_turn.tool_config_path` names,

    tools:
      - class_name: dsec.adapters.verl_tool.DsecSandboxTool
        config: {type: native, image: debian-python, language: python}
        tool_schema: {...}        # optional: the default is run_code(code)

`create_kwargs` (verl's per-sample `tools_kwargs[<tool name>].create_kwargs`) may carry `files`
({path: text}) written into the trajectory's sandbox when it is created. config: url, api_key
(else DSEC_URL / DSEC_API_KEY), image, cpu_cores, memory_mb, ttl_idle_s, timeout_s (per call),
language (python | bash), reward_command (calc_reward: 1.0 when it exits 0 in the sandbox).
"""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from dsec.sdk.client import Client, Sandbox
from dsec.types import ContainerArgs, DsecError

DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "run_code",
        "description": "Run code in this task's sandbox; files persist between calls. Returns stdout and stderr.",
        "parameters": {"type": "object", "required": ["code"],
                       "properties": {"code": {"type": "string", "description": "the code to run"}}},
    },
}
LANGUAGES = {"python": "python3 -", "bash": "bash -s"}


def _trajectory(instance_id: str, kwargs: dict[str, Any]) -> str:
    """The trajectory a call belongs to: verl's request id (in the agent data it passes), else
    the instance (a direct call without agent data)."""
    return getattr(kwargs.get("agent_data"), "request_id", None) or instance_id


class DsecSandboxTool(BaseTool):
    """verl BaseTool: run_code in one dsec sandbox per trajectory."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(DEFAULT_SCHEMA)
        super().__init__(config, schema)
        language = str(config.get("language", "python"))
        if language not in LANGUAGES:
            raise ValueError(f"DsecSandboxTool config.language={language!r}: use one of {sorted(LANGUAGES)}")
        self._command = LANGUAGES[language]
        self._timeout_s = float(config.get("timeout_s", 30.0))
        self._args = ContainerArgs(image=config.get("image", "debian-python"),
                                   cpu_cores=float(config.get("cpu_cores", 1.0)),
                                   memory_mb=int(config.get("memory_mb", 512)),
                                   ttl_idle_s=int(config.get("ttl_idle_s", 600)),
                                   labels={"verl-tool": self.name})
        self._url, self._key = config.get("url"), config.get("api_key")
        self._clients: dict[int, Client] = {}          # one per event loop (httpx pools are per loop)
        self._create_kwargs: dict[str, dict[str, Any]] = {}   # instance -> its create_kwargs
        self._sandboxes: dict[str, Sandbox] = {}       # trajectory -> its sandbox
        self._creating: dict[str, asyncio.Task[Sandbox]] = {}

    def _client(self) -> Client:
        loop = id(asyncio.get_running_loop())
        c = self._clients.get(loop)
        if c is None:
            c = self._clients[loop] = Client(self._url, self._key)
        return c

    # -- verl's BaseTool API

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._create_kwargs[instance_id] = dict(kwargs.get("create_kwargs") or {})
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict]:
        create_kwargs = self._create_kwargs.get(instance_id, {})
        trajectory = _trajectory(instance_id, kwargs)
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="Error: the `code` argument is missing or empty."), 0.0, {}
        try:
            sandbox = await self._sandbox(trajectory, create_kwargs)
            r = await sandbox.run(self._command, stdin=code, timeout_s=self._timeout_s)
        except DsecError as e:       # the model sees why (quota, a bad image...); the loop goes on
            return ToolResponse(text=f"Error: {e}"), 0.0, {"error": type(e).__name__}
        if r.timed_out:
            text = f"Error: the code ran past {self._timeout_s:g} s and was stopped.\n{r.stdout}{r.stderr}"
        else:
            text = r.stdout + (f"\n[stderr]\n{r.stderr}" if r.stderr else "")
            if r.exit_code != 0:
                text += f"\n[exit code {r.exit_code}]"
        return ToolResponse(text=text.strip() or "(no output)"), 0.0, {
            "exit_code": r.exit_code, "timed_out": r.timed_out, "sandbox_id": sandbox.id}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """1.0 when config.reward_command exits 0 in the trajectory's sandbox, else 0.0."""
        command = self.config.get("reward_command")
        sandbox = self._sandboxes.get(_trajectory(instance_id, kwargs))
        if not command or sandbox is None:
            return 0.0
        r = await sandbox.run(str(command), timeout_s=float(self.config.get("reward_timeout_s", 60)))
        return 1.0 if r.exit_code == 0 and not r.timed_out else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        # verl releases after every call: the trajectory's sandbox stays for its next call
        self._create_kwargs.pop(instance_id, None)

    # -- dsec's part

    async def _sandbox(self, trajectory: str, create_kwargs: dict[str, Any]) -> Sandbox:
        sb = self._sandboxes.get(trajectory)
        if sb is not None:
            return sb
        task = self._creating.get(trajectory)
        if task is None:        # parallel calls of one turn share one creation
            task = self._creating[trajectory] = asyncio.ensure_future(self._new_sandbox(trajectory, create_kwargs))
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._creating.pop(trajectory, None)

    async def _new_sandbox(self, trajectory: str, create_kwargs: dict[str, Any]) -> Sandbox:
        args = self._args.model_copy(update={"labels": {**self._args.labels, "verl-trajectory": trajectory[:63]}})
        sb = await self._client().create_container(args)
        try:
            for path, text in (create_kwargs.get("files") or {}).items():
                await sb.files.write(path, text, mkdirs=True)
        except BaseException:
            await sb.stop()
            raise
        self._sandboxes[trajectory] = sb
        return sb

    def trajectory_sandboxes(self) -> dict[str, Sandbox]:
        """The live sandboxes of this tool: {trajectory (verl request id): sandbox}."""
        return dict(self._sandboxes)

    async def end_trajectory(self, trajectory: str) -> None:
        """Stop a trajectory's sandbox now (else its idle TTL ends it)."""
        sb = self._sandboxes.pop(trajectory, None)
        if sb is not None:
            await sb.stop()

    async def close(self) -> None:
        """Stop every sandbox this tool made and close its clients."""
        for trajectory in list(self._sandboxes):
            await self.end_trajectory(trajectory)
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
