"""The create path's own costs (issue 29, part B): how many starts the edge runs at once
(DSEC_CREATE_PARALLEL), and no LIST_EXECS round trip to an agent that was just started."""

from __future__ import annotations

import asyncio

import pytest

from dsec.agent.client import AgentClient
from dsec.settings import Settings
from dsec.testing.fake_backend import FakeBackend
from dsec.types import ContainerArgs, ExecRequest, InvalidArgument

from ._helpers import Node

ARGS = ContainerArgs(image="busybox")


def test_create_parallel_is_a_setting_with_bounds():
    assert Settings.from_env({}).edge.create_parallel == 4
    assert Settings.from_env({"DSEC_CREATE_PARALLEL": "12"}).edge.create_parallel == 12
    with pytest.raises(InvalidArgument) as e:
        Settings.from_env({"DSEC_CREATE_PARALLEL": "0"})
    assert e.value.field == "DSEC_CREATE_PARALLEL" and "greater than or equal to 1" in e.value.message


async def test_the_edge_starts_as_many_at_once_as_the_setting_says(node: Node, fake: FakeBackend,
                                                                  monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DSEC_CREATE_PARALLEL", "6")
    edge = await node.start()
    inflight, peak = 0, 0
    create = fake.create

    async def counted(*a, **kw):   # type: ignore[no-untyped-def]
        nonlocal inflight, peak
        inflight += 1
        peak = max(peak, inflight)
        try:
            await asyncio.sleep(0.2)     # every start overlaps the others that were let in
            return await create(*a, **kw)
        finally:
            inflight -= 1
    monkeypatch.setattr(fake, "create", counted)
    infos = await asyncio.gather(*(edge.create("p", ARGS) for _ in range(9)))
    assert peak == 6
    for i in infos:
        await edge.stop(i.id)


@pytest.mark.parametrize("fresh", [True, False])
async def test_a_just_started_agent_is_not_asked_for_its_chans(edge, fake: FakeBackend, fresh: bool,
                                                               monkeypatch: pytest.MonkeyPatch):
    """A container's agent is a new process at every create: it has no chans to list. A backend
    that may restore one (a VM clone) still lists them."""
    monkeypatch.setattr(fake, "fresh_agent_at_create", fresh, raising=False)
    listed = 0
    list_execs = AgentClient.list_execs

    async def counting(self):   # type: ignore[no-untyped-def]
        nonlocal listed
        listed += 1
        return await list_execs(self)
    monkeypatch.setattr(AgentClient, "list_execs", counting)
    info = await edge.create("p", ARGS)
    assert listed == (0 if fresh else 1)
    # chans start where a fresh agent expects them: commands run, one after another
    for _ in range(2):
        r = await edge.run(info.id, ExecRequest(cmd="echo hi"))
        assert (r.stdout, r.exit_code) == ("hi\n", 0)
    await edge.stop(info.id)


def test_only_the_container_backend_declares_fresh_agents():
    from dsec.backends.container.driver import ContainerDriver
    from dsec.backends.vm.driver import VMDriver
    assert ContainerDriver.fresh_agent_at_create and not VMDriver.fresh_agent_at_create
