"""A backend without a runtime, for the edge's unit tests: each "sandbox" is an `AgentStub`.

`FakeBackend` implements the core `Backend` interface (dsec.backends.base) and plays the
node's runtime: it outlives an `Edge`, so a second Edge on the same home and the same
FakeBackend is an edge restart with sandboxes still running. Sandbox `ID` lives in
`root/ID/` (`fs/` is its `/`, `run/agent.sock` its agent socket); a dir whose stub is gone is
what a dead container leaves, and `list_ids` reports it as "dead".

Fault injection for tests:
- `fail_next(stage, error)`: the next call of that stage raises `error` (stages: prepare,
  create (before anything exists), create_after_agent (the agent was up; the fake cleans up as
  the contract says unless `leave_behind`), wait_agent, ready, destroy);
- `kill(id, reason)`: the sandbox dies (its stub stops, `is_running` is False, `end_reason`
  says `reason`);
- `create_delay_s`: every create waits this long first.

`ParkingFakeBackend` adds the Parking capability (park = the stub stops listening, its
commands carry on; unpark = it listens again). `ReclaimFakeBackend` adds Reclaim to that
(idle reclaim, edge/reclaim.py): it records the call and reports RECLAIM_BYTES.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar, Literal

from dsec.agent.client import AgentClient
from dsec.backends.base import PARKED, RUNNING, Backend, ImageStacks, Parking, Prepared, Reclaim
from dsec.types import SandboxArgs

from .agent_stub import AgentStub

Stage = Literal["prepare", "create", "create_after_agent", "wait_agent", "ready", "destroy"]
DEAD = "dead"                 # list_ids: a sandbox dir without a live stub
SOCKET_MAX = 107              # sun_path holds 108 bytes with the NUL


class FakeBackend(Backend):
    kinds: ClassVar[tuple[str, ...]] = ("container",)

    def __init__(self, root: Path | None = None, kinds: Iterable[str] = ("container",), *,
                 uid: int = 1000, gid: int = 1000):
        self.kinds = tuple(kinds)   # type: ignore[misc]  # per instance: one fake per kind set
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="dsec-fake-"))
        self.uid, self.gid = uid, gid
        self.stubs: dict[str, AgentStub] = {}
        self.calls: list[tuple[str, str]] = []   # (verb, sandbox id or kind) in call order
        self.recovered: set[str] | None = None   # live ids the last recover() got
        self.create_delay_s = 0.0
        self._faults: dict[str, tuple[BaseException, bool]] = {}
        self._end_reasons: dict[str, str] = {}
        self._end_codes: dict[str, str] = {}

    # -- knobs for tests -----------------------------------------------------------------
    def fail_next(self, stage: Stage, error: BaseException, *, leave_behind: bool = False) -> None:
        """The next call of `stage` raises `error`. leave_behind (create_after_agent only): the
        fake breaks the contract and leaves the running stub, as a buggy backend would."""
        self._faults[stage] = (error, leave_behind)

    async def kill(self, sandbox_id: str, reason: str = "killed by the test", code: str = "agent_died") -> None:
        """The sandbox dies: its commands are killed, its agent is gone, its dir stays.
        `code`: the end reason (types/events.py) end_code() answers for it."""
        self._end_reasons[sandbox_id] = reason
        self._end_codes[sandbox_id] = code
        stub = self.stubs.pop(sandbox_id, None)
        if stub is not None:
            await stub.stop()

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def fs(self, sandbox_id: str) -> Path:
        """The host dir that is the sandbox's `/`."""
        return self.sandbox_dir(sandbox_id) / "fs"

    def _fault(self, stage: Stage) -> tuple[BaseException, bool] | None:
        return self._faults.pop(stage, None)

    def _raise(self, stage: Stage) -> None:
        fault = self._fault(stage)
        if fault is not None:
            raise fault[0]

    # -- the core interface ----------------------------------------------------------------
    async def prepare(self, args: SandboxArgs, images: ImageStacks) -> Prepared:
        self.calls.append(("prepare", args.backend))
        self._raise("prepare")
        return Prepared(args=args, image_digest=None, uid=self.uid, gid=self.gid)

    async def create(self, sandbox_id: str, prepared: Prepared, images: ImageStacks) -> None:
        self.calls.append(("create", sandbox_id))
        if self.create_delay_s:
            await asyncio.sleep(self.create_delay_s)
        self._raise("create")
        sock = self.agent_socket(sandbox_id)
        if len(str(sock)) > SOCKET_MAX:
            raise ValueError(f"socket path too long for AF_UNIX: {sock} (use a shorter root)")
        stub = AgentStub(sock, self.fs(sandbox_id), workdir=prepared.args.workdir)
        try:
            await stub.start()
        except BaseException:
            await stub.stop()
            shutil.rmtree(self.sandbox_dir(sandbox_id), ignore_errors=True)
            raise
        self.stubs[sandbox_id] = stub
        fault = self._fault("create_after_agent")
        if fault is not None:
            error, leave_behind = fault
            if not leave_behind:
                await self._free(sandbox_id)
            raise error

    async def wait_agent(self, sandbox_id: str) -> AgentClient:
        self.calls.append(("wait_agent", sandbox_id))
        self._raise("wait_agent")
        return await super().wait_agent(sandbox_id)

    async def ready(self, sandbox_id: str, agent: AgentClient) -> None:
        self._raise("ready")

    async def destroy(self, sandbox_id: str) -> None:
        self.calls.append(("destroy", sandbox_id))
        self._raise("destroy")
        await self._free(sandbox_id)

    async def _free(self, sandbox_id: str) -> None:
        stub = self.stubs.pop(sandbox_id, None)
        if stub is not None:
            await stub.stop()
        shutil.rmtree(self.sandbox_dir(sandbox_id), ignore_errors=True)

    async def is_running(self, sandbox_id: str) -> bool:
        stub = self.stubs.get(sandbox_id)
        return stub is not None and stub.serving

    async def list_ids(self) -> dict[str, str]:
        on_disk = [p.name for p in self.root.iterdir() if p.is_dir()] if self.root.exists() else []
        return {i: self._state(i) for i in on_disk}

    def _state(self, sandbox_id: str) -> str:
        stub = self.stubs.get(sandbox_id)
        return RUNNING if stub is not None and stub.serving else DEAD

    def agent_socket(self, sandbox_id: str) -> Path:
        return self.sandbox_dir(sandbox_id) / "run" / "agent.sock"

    def end_reason(self, sandbox_id: str, cause: BaseException | None) -> str:
        return self._end_reasons.get(sandbox_id) or super().end_reason(sandbox_id, cause)

    def end_code(self, sandbox_id: str) -> str:
        return self._end_codes.get(sandbox_id) or super().end_code(sandbox_id)

    async def recover(self, live_ids: set[str]) -> None:
        self.recovered = set(live_ids)

    async def close(self) -> None:
        """End of the test: stop every stub and remove the root (what a node reboot does)."""
        for sandbox_id in list(self.stubs):
            await self._free(sandbox_id)
        shutil.rmtree(self.root, ignore_errors=True)


class ParkingFakeBackend(FakeBackend, Parking):
    """A fake that can park: the stub stops listening (no agent), its commands carry on."""

    PARK_BYTES = 4096

    def __init__(self, root: Path | None = None, kinds: Iterable[str] = ("microvm",), **kw: int):
        super().__init__(root, kinds, **kw)
        self.parked: set[str] = set()

    async def park(self, sandbox_id: str) -> int:
        self.calls.append(("park", sandbox_id))
        await self.stubs[sandbox_id].suspend()
        self.parked.add(sandbox_id)
        return self.PARK_BYTES

    async def unpark(self, sandbox_id: str) -> None:
        self.calls.append(("unpark", sandbox_id))
        await self.stubs[sandbox_id].start()
        self.parked.discard(sandbox_id)

    async def _free(self, sandbox_id: str) -> None:
        self.parked.discard(sandbox_id)
        await super()._free(sandbox_id)

    def _state(self, sandbox_id: str) -> str:
        if sandbox_id in self.parked and sandbox_id in self.stubs:
            return PARKED
        return super()._state(sandbox_id)


class ReclaimFakeBackend(ParkingFakeBackend, Reclaim):
    """Parking and Reclaim (containers' capabilities): reclaim records the call, waits
    `reclaim_delay_s` and reports RECLAIM_BYTES; `max_reclaiming` is how many ran at once."""

    RECLAIM_BYTES = 64 << 20

    def __init__(self, root: Path | None = None, kinds: Iterable[str] = ("container",), **kw: int):
        super().__init__(root, kinds, **kw)
        self.reclaim_delay_s = 0.0
        self.reclaiming = 0
        self.max_reclaiming = 0

    async def reclaim(self, sandbox_id: str) -> int:
        self.calls.append(("reclaim", sandbox_id))
        if sandbox_id in self.parked or sandbox_id not in self.stubs:
            raise AssertionError(f"reclaim of a parked or gone sandbox {sandbox_id}")
        self.reclaiming += 1
        self.max_reclaiming = max(self.max_reclaiming, self.reclaiming)
        try:
            await asyncio.sleep(self.reclaim_delay_s)
        finally:
            self.reclaiming -= 1
        return self.RECLAIM_BYTES

    def reclaimed(self) -> list[str]:
        """The sandboxes reclaimed so far, in call order."""
        return [sid for verb, sid in self.calls if verb == "reclaim"]
