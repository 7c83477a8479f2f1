"""A SkyRL-gym episode on dsec with a scripted toy policy (no model): the environment seeds a
buggy module and its test in a fresh sandbox, the "policy" reads, patches and ends; the reward
is whether the test passes in the sandbox.

    pip install '.[skyrl]'; python examples/skyrl_gym_episode.py
"""

from __future__ import annotations

import skyrl_gym

import dsec.adapters.skyrl_gym  # noqa: F401  registers "dsec-code"

BUGGY = "def add(a, b):\n    return a - b\n"
TEST = "from sol import add\n\nassert add(2, 3) == 5, add(2, 3)\n"

SCRIPT = [
    "<tool><bash>cd /work && cat sol.py && python3 test_sol.py</bash></tool>",
    "<tool><python>import pathlib; p = pathlib.Path('/work/sol.py'); "
    "p.write_text(p.read_text().replace('a - b', 'a + b')); print('patched')</python></tool>",
    "<solution>fixed add()</solution>",
]


def main() -> None:
    env = skyrl_gym.make("dsec-code", env_config={"image": "debian-python"},
                         extras={"reward_spec": {"test_command": "cd /work && python3 test_sol.py"},
                                 "files": {"/work/sol.py": BUGGY, "/work/test_sol.py": TEST}, "max_turns": 6})
    _, meta = env.init([{"role": "user", "content": "Make test_sol.py pass."}])
    print("sandbox", meta["sandbox_id"])
    try:
        for action in SCRIPT:
            out = env.step(action)
            for obs in out["observations"]:
                print("observation:", obs["content"])
            if out["done"]:
                print("reward:", out["reward"])
                break
    finally:
        env.close()


if __name__ == "__main__":
    main()
