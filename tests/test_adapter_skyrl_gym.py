"""The SkyRL-gym adapter (dsec.adapters.skyrl_gym) driven through skyrl-gym's own registry,
`make` and BaseTextEnv machinery (the skyrl-gym package from PyPI) against a real dsec server."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym not installed: pip install -e '.[skyrl]'")

from dsec.adapters.skyrl_gym import ENV_ID, DsecToolGroup  # noqa: E402

BUGGY = "def add(a, b):\n    return a - b\n"
TEST = "from sol import add\n\nassert add(2, 3) == 5, add(2, 3)\n"


def make_env(server, **extras):
    extras.setdefault("reward_spec", {"test_command": "cd /work && python3 test_sol.py"})
    extras.setdefault("files", {"/work/sol.py": BUGGY, "/work/test_sol.py": TEST})
    return skyrl_gym.make(ENV_ID, env_config={"url": server.url, "api_key": server.key, "memory_mb": 256,
                                              "tool_timeout_s": 5},
                          extras=extras)


def test_scripted_policy_fixes_the_bug_and_is_rewarded(server, run_sync):
    def episode():
        env = make_env(server, max_turns=6)
        prompt, meta = env.init([{"role": "user", "content": "make the test pass"}])
        assert prompt[0]["content"] == "make the test pass" and meta["sandbox_id"]
        out = env.step("<tool><bash>cd /work && cat sol.py</bash></tool>")
        assert "a - b" in out["observations"][0]["content"] and not out["done"]
        out = env.step("<tool><python>import pathlib; p = pathlib.Path('/work/sol.py'); "
                       "p.write_text(p.read_text().replace('a - b', 'a + b')); print('patched')</python></tool>")
        assert out["observations"][0]["content"] == "patched"
        out = env.step("<tool><bash>pwd; export X=7</bash></tool>")    # the bash session keeps cwd, env
        assert out["observations"][0]["content"] == "/work"
        out = env.step("<tool><bash>echo $X; pwd</bash></tool>")
        assert out["observations"][0]["content"] == "7\n/work"
        out = env.step("<solution>done</solution>")
        assert out["done"] and out["reward"] == 1.0
        env.close()
        return meta["sandbox_id"]
    sid = run_sync(episode)
    assert sid


def test_unfixed_bug_gets_no_reward_and_errors_are_observations(server, run_sync):
    def episode():
        env = make_env(server, max_turns=4)
        env.init([{"role": "user", "content": "x"}])
        out = env.step("<tool><python>raise SystemExit('boom')</python></tool>")
        assert out["observations"][0]["content"].startswith("Error executing Python code: boom")
        out = env.step("<tool><python>while True: pass</python></tool>")
        assert "timed out after 5.0 seconds" in out["observations"][0]["content"]
        out = env.step("no tool here")
        assert "No <tool>" in out["observations"][0]["content"]
        out = env.step("<tool><bash>true</bash></tool>")                   # 4th turn: the last
        assert out["done"] and out["reward"] == 0.0
        env.close()
    run_sync(episode)


def test_ground_truth_reward(server, run_sync):
    def episode():
        env = make_env(server, reward_spec={"ground_truth": "42"}, files={})
        env.init([])
        out = env.step("<tool><python>print(6*7)</python></tool>")
        assert out["observations"][0]["content"] == "42"
        assert env.step("<solution> 42 </solution>")["reward"] == 1.0
        env.close()
    run_sync(episode)


async def test_close_leaves_no_sandbox_and_tools_never_run_on_the_host(server, client, run_sync):
    """The model's code runs in the sandbox: a file it writes is not on the host, and it cannot
    see the host's files; close() stops the sandbox."""
    marker = f"/tmp/skyrl-{uuid.uuid4().hex}"
    host_secret = Path(f"/tmp/host-secret-{uuid.uuid4().hex}")
    host_secret.write_text("secret")
    try:
        def episode() -> str:
            env = make_env(server, reward_spec={"ground_truth": "x"}, files={})
            _, meta = env.init([])
            group = env.tool_groups[0]
            assert isinstance(group, DsecToolGroup)
            assert group.python(f"open('{marker}', 'w').write('x'); print('ok')") == "ok"
            seen = group.bash(f"cat {host_secret}")
            assert "secret" not in seen.replace(str(host_secret), "") and "[exit code 1]" in seen, seen
            env.close()
            return str(meta["sandbox_id"])
        sid = run_sync(episode)
        assert not os.path.exists(marker)
        info = await (await client.get(sid)).refresh()
        assert info.state.value in ("stopped", "stopping"), info
    finally:
        host_secret.unlink()


def test_python_tool_answers_what_skyrls_own_tool_answers(server, run_sync, monkeypatch):
    """Issue 23: the docs promise PythonCodeExecutorToolGroup's result strings, tracebacks
    included; the code ran from stdin and tracebacks said "<stdin>" where SkyRL's say "<string>"."""
    from skyrl_gym.tools.python import PythonCodeExecutorToolGroup
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")   # its `python`
    codes = ["print(6*7)", "import sys; print(sys.argv)", "1/0", "def f(:\n  pass",
             "import sys; print('out'); print('err', file=sys.stderr)", "x = 'a'\nraise KeyError(x)\n\n"]

    def answers() -> list[str]:
        env = make_env(server, reward_spec={"ground_truth": "x"}, files={})
        env.init([])
        try:
            group = env.tool_groups[0]
            big = "x = 1\n" * 30_000 + "print(x + 1)"       # past one argument's 128 KiB: from stdin
            return [group.python(c) for c in codes] + [group.python(big)]
        finally:
            env.close()
    got = run_sync(answers)
    host = PythonCodeExecutorToolGroup()
    assert got[:-1] == [host.python(c) for c in codes]
    assert 'File "<string>", line 1' in got[2] and got[-1] == "2"


def test_bad_reward_spec_is_refused(server):
    with pytest.raises(ValueError, match="reward_spec"):
        make_env(server, reward_spec={})


@pytest.fixture
def run_sync():
    """Runs blocking adapter code off the test's event loop (the sync SDK has its own loop)."""
    import asyncio
    import concurrent.futures

    def run(fn):
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return fn()
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            return ex.submit(fn).result()
    return run
