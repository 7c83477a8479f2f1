"""A small SWE-like episode through SWE-ReX's API on a dsec sandbox, driven by a scripted toy
policy (no model): write a buggy module and its test, run the test, read the failure, fix the
bug, run it again, read the file back, close. `benchmarks/swerex_rollouts.py` runs the same
episode many times, on dsec and on SWE-ReX's own deployments.

    python examples/swerex_episode.py                    # the local dsec (started if not running)
    DSEC_URL=http://host:7620 DSEC_API_KEY=... python examples/swerex_episode.py

Needs `pip install '.[swerex]'` (in the checkout).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from swerex.deployment.abstract import AbstractDeployment
from swerex.exceptions import CommandTimeoutError
from swerex.runtime.abstract import (BashAction, BashInterruptAction, CloseBashSessionRequest, Command,
                                     CreateBashSessionRequest, ReadFileRequest, WriteFileRequest)

BUGGY = "def add(a, b):\n    return a - b\n"
TEST = ("from calc import add\n\n"
        "assert add(2, 3) == 5, f'add(2, 3) returned {add(2, 3)}'\n"
        "print('all tests passed')\n")


@dataclass
class Episode:
    reward: float = 0.0
    steps: list[tuple[str, str]] = field(default_factory=list)   # (action, observation)

    def log(self, action: str, observation: str) -> None:
        self.steps.append((action, observation.strip()))


async def run_episode(deployment: AbstractDeployment, *, workdir: str | None = None,
                      with_timeout: bool = False) -> Episode:
    """One episode on a started deployment. `with_timeout`: the policy also runs a command that
    hangs, gets SWE-ReX's timeout error, interrupts, and carries on (SWE-agent's recovery path)."""
    rt = deployment.runtime
    work = workdir or f"/tmp/episode-{uuid.uuid4().hex[:8]}"
    ep = Episode()
    await rt.create_session(CreateBashSessionRequest(startup_timeout=10))   # SWE-ReX's 1 s is tight on a busy host
    await rt.run_in_session(BashAction(command=f"mkdir -p {work} && cd {work}"))
    await rt.write_file(WriteFileRequest(path=f"{work}/calc.py", content=BUGGY))
    await rt.write_file(WriteFileRequest(path=f"{work}/test_calc.py", content=TEST))
    ep.log("write calc.py, test_calc.py", "")

    # -B: no .pyc; a fix written within the same second, at the same size, would not be re-read
    obs = await rt.run_in_session(BashAction(command="python3 -B test_calc.py", check="silent", timeout=60))
    ep.log(f"python3 -B test_calc.py  -> exit {obs.exit_code}", obs.output)

    if with_timeout:
        try:
            await rt.run_in_session(BashAction(command="python3 -c 'while True: pass'", timeout=1))
        except CommandTimeoutError as e:
            ep.log("python3 -c 'while True: pass'  -> timeout", str(e).split(" (")[0])
            await rt.run_in_session(BashInterruptAction())

    # the "policy": the failure names add(); read the source, fix the operator
    if obs.exit_code != 0 and "add(2, 3) returned -1" in obs.output:
        src = (await rt.read_file(ReadFileRequest(path=f"{work}/calc.py"))).content
        await rt.write_file(WriteFileRequest(path=f"{work}/calc.py", content=src.replace("a - b", "a + b")))
        ep.log("fix calc.py: a - b -> a + b", "")

    obs = await rt.run_in_session(BashAction(command="python3 -B test_calc.py", check="silent", timeout=60))
    ep.log(f"python3 -B test_calc.py  -> exit {obs.exit_code}", obs.output)
    final = (await rt.read_file(ReadFileRequest(path=f"{work}/calc.py"))).content
    ep.log("read calc.py", final)
    r = await rt.execute(Command(command=["rm", "-rf", work]))
    ep.log(f"rm -rf {work}  -> exit {r.exit_code}", "")
    await rt.close_session(CloseBashSessionRequest())
    ep.reward = 1.0 if obs.exit_code == 0 and "a + b" in final else 0.0
    return ep


async def main() -> None:
    from dsec.adapters.swerex import DsecDeploymentConfig

    # The one change from SWE-ReX's docker: this config instead of DockerDeploymentConfig(image=...).
    deployment = DsecDeploymentConfig(image="debian-python", memory_mb=512).get_deployment()
    t0 = time.monotonic()
    await deployment.start()
    print(f"sandbox {deployment.sandbox_id} ready in {time.monotonic() - t0:.2f}s")
    try:
        ep = await run_episode(deployment, with_timeout=True)
    finally:
        await deployment.stop()
    for action, observation in ep.steps:
        print(f"$ {action}")
        for line in observation.splitlines():
            print(f"    {line}")
    print(f"reward {ep.reward}  ({time.monotonic() - t0:.2f}s, sandbox removed)")
    assert ep.reward == 1.0


if __name__ == "__main__":
    asyncio.run(main())
