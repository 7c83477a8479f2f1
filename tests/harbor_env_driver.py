"""Run by tests/test_harbor_adapter.py with Harbor's Python (>= 3.12, .venv-harbor): Harbor's own
EnvironmentFactory loads dsec.adapters.harbor:DsecEnvironment by import path, and the
environment interface is driven against the dsec server at $DSEC_URL. Prints one JSON line
with what it saw; any failed check raises."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from harbor.environments.factory import EnvironmentFactory
from harbor.models.task.config import EnvironmentConfig as TaskEnvConfig
from harbor.models.trial.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths


async def main(tmp: Path) -> dict:
    env_dir = tmp / "environment"
    env_dir.mkdir()
    trial_paths = TrialPaths(trial_dir=tmp / "trial")
    trial_paths.mkdir()
    env = EnvironmentFactory.create_environment_from_config(
        EnvironmentConfig(import_path="dsec.adapters.harbor:DsecEnvironment", env={"PERSIST": "p1"},
                          kwargs={"url": os.environ["DSEC_URL"], "api_key": os.environ["DSEC_API_KEY"]}),
        environment_dir=env_dir, environment_name="driver", session_id="driver__abc__env",
        trial_paths=trial_paths,
        task_env_config=TaskEnvConfig(docker_image="debian-python", memory_mb=512, cpus=1),
    )
    seen: dict = {"type": env.type()}
    await env.start(force_build=False)
    try:
        r = await env.exec("pwd; echo $PERSIST $ONE; id -u", cwd="/tmp", env={"ONE": "1"})
        assert r.return_code == 0 and r.stdout.split() == ["/tmp", "p1", "1", "0"], r
        r = await env.exec("echo out; echo err >&2; exit 3")
        assert (r.return_code, r.stdout, r.stderr) == (3, "out\n", "err\n"), r
        r = await env.exec("id -u", user="nobody")
        assert r.stdout.strip() == "65534", r
        try:
            await env.exec("sleep 30", timeout_sec=1)
            raise AssertionError("a command past its timeout returned")
        except RuntimeError as e:
            assert "timed out after 1 seconds" in str(e), e
            seen["timeout"] = str(e)

        src = tmp / "up"
        (src / "sub").mkdir(parents=True)
        (src / "a.txt").write_text("A")
        (src / "sub" / "b.bin").write_bytes(bytes(range(256)) * 1000)
        await env.upload_dir(src, "/data/in")           # a new top-level dir
        await env.upload_file(src / "a.txt", "/opt/one/a.txt")
        r = await env.exec("cat /data/in/a.txt; echo; cat /opt/one/a.txt; echo; wc -c < /data/in/sub/b.bin")
        assert r.stdout.split() == ["A", "A", "256000"], r
        assert await env.is_dir("/data/in/sub") and await env.is_file("/data/in/a.txt")

        await env.exec("mkdir -p /data/out/deep && echo X > /data/out/deep/x.txt && echo Y > /data/out/y.txt")
        down = tmp / "down"
        await env.download_dir("/data/out", down)
        assert (down / "deep" / "x.txt").read_text() == "X\n" and (down / "y.txt").read_text() == "Y\n"
        await env.download_file("/data/in/sub/b.bin", tmp / "b.bin")
        assert (tmp / "b.bin").read_bytes() == (src / "sub" / "b.bin").read_bytes()
        try:
            await env.download_file("/nope/missing", tmp / "missing")
            raise AssertionError("downloading a missing file succeeded")
        except FileNotFoundError:
            pass
        # Harbor's top-level dirs exist, so its own `mkdir -p /logs/verifier` works (a command
        # may not create a directory under / in a dsec sandbox)
        r = await env.exec("mkdir -p /logs/verifier /tests/x && echo ok")
        assert r.stdout.strip() == "ok", r
        seen["sandbox_id"] = env._sb().id
    finally:
        await env.stop(delete=True)
    return seen


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(asyncio.run(main(Path(d)))))
    sys.exit(0)
