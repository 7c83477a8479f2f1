"""One verl agent-loop trajectory whose tool calls run in a dsec sandbox.

verl's own code does the work: its tool registry loads `DsecSandboxTool` from a tool-config
YAML (what `actor_rollout_ref.rollout.multi_turn.tool_config_path` names in a trainer config),
and its ToolAgentLoop runs the trajectory: builds the prompt with the chat template, asks the
"LLM server" for a turn, parses hermes `<tool_call>`s, calls the tool, appends the tool's answer
and loops. The policy is scripted (no model weights): a stand-in server manager answers each
turn with fixed text, tokenized by a byte-level tokenizer built here. Turn 1 writes a file in the
sandbox, turn 2 reads it back (state kept across the tool's per-call instances), turn 3 answers.

    DSEC_URL=... DSEC_API_KEY=... .venv-verl/bin/python examples/verl_tool_episode.py

Prints one JSON line: the tool answers, the turns and the reward.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.tool_registry import load_all_tools
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

TOOL_CONFIG = """\
tools:
  - class_name: dsec.adapters.verl_tool.DsecSandboxTool
    config:
      type: native
      image: debian-python
      language: python
      timeout_s: 30
      ttl_idle_s: 300
      reward_command: "test \\"$(cat /work/answer.txt)\\" = 42"
"""

# hermes-style: tools in the system turn, tool calls as <tool_call>{json}</tool_call>
CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{%- for c in (m.tool_calls or []) %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|end|>\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content if m.content is string else m.content | tojson }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")

SCRIPT = [   # the scripted policy's turns
    '<tool_call>{"name": "run_code", "arguments": {"code": '
    '"import os\\nos.makedirs(\'/work\', exist_ok=True)\\nopen(\'/work/answer.txt\', \'w\').write(str(6 * 7))\\n'
    'print(open(\'/work/task.txt\').read().strip())"}}</tool_call>',
    '<tool_call>{"name": "run_code", "arguments": {"code": "print(\'answer is\', open(\'/work/answer.txt\').read())"}}'
    '</tool_call>',
    "The answer is 42.",
]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Every byte one token (no merges): decode(encode(text)) == text, no weights to download."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


class ScriptedServer:
    """verl's LLM server manager interface (generate), answering each trajectory's turns from SCRIPT."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast):
        self.tokenizer = tokenizer
        self.turns: dict[str, int] = {}

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **_: Any) -> TokenOutput:
        n = self.turns.get(request_id, 0)
        self.turns[request_id] = n + 1
        ids = self.tokenizer.encode(SCRIPT[min(n, len(SCRIPT) - 1)], add_special_tokens=False)
        return TokenOutput(token_ids=ids + [self.tokenizer.eos_token_id], stop_reason="completed")


def trainer_config(tool_config: Path) -> Any:
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": 8192, "response_length": 8192, "full_determinism": False,
        "multi_turn": {"max_user_turns": 6, "max_assistant_turns": 6, "max_parallel_calls": 1,
                       "max_tool_response_length": 4096, "tool_response_truncate_side": "middle",
                       "format": "hermes", "tool_config_path": str(tool_config), "function_tool_path": None}}}})


async def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "tools.yaml"
        cfg_path.write_text(TOOL_CONFIG)
        tools = load_all_tools(str(cfg_path), None)        # verl's registry imports our class
        tool = tools[0]
        tokenizer = byte_tokenizer()
        loop = ToolAgentLoop(trainer_config=DictConfigWrap(trainer_config(cfg_path)),
                             server_manager=ScriptedServer(tokenizer), tokenizer=tokenizer, processor=None,
                             dataset_cls=RLHFDataset, data_config=DictConfigWrap(OmegaConf.create({})),
                             tools=ToolListWrap(tools))
        try:
            out = await loop.run(sampling_params={}, raw_prompt=[{"role": "user", "content": "What is 6 times 7?"}],
                                 tools_kwargs={tool.name: {"create_kwargs": {
                                     "files": {"/work/task.txt": "multiply six by seven"}}}})
            text = tokenizer.decode(out.response_ids)
            sandboxes = tool.trajectory_sandboxes()      # {request id: sandbox}: one per trajectory
            reward = await tool.calc_reward(next(iter(sandboxes), ""))
            return {"num_turns": out.num_turns, "response": text, "reward": reward,
                    "sandbox_ids": [sb.id for sb in sandboxes.values()]}
        finally:
            await tool.close()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = asyncio.run(main())
    sys.stdout.write(json.dumps(result) + "\n")
