import asyncio
import time

import pytest

from dsec.types import NodeCapacity, NodeStatus
from dsec.watcher import EdgeLike, Watcher


def status(node_id: str, n: int = 0) -> NodeStatus:
    return NodeStatus(node_id=node_id, healthy=True, backends=["container"],
                      capacity=NodeCapacity(cpu_cores=8, memory_mb=16384, max_sandboxes=100),
                      sandboxes=n)


class Edge:
    """A small edge stand-in: counts polls, and can be told to fail or hang."""

    def __init__(self, node_id: str, delay_s: float = 0.0):
        self.node_id = node_id
        self.delay_s = delay_s
        self.sandboxes = 0
        self.polls = 0
        self.fail: Exception | None = None
        self.hang = False

    async def status(self) -> NodeStatus:
        self.polls += 1
        if self.hang:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return status(self.node_id, self.sandboxes)


async def test_edge_satisfies_protocol():
    assert isinstance(Edge("a"), EdgeLike)


async def test_poll_once_reports_every_node_and_failures_as_unhealthy():
    ok, broken, hung = Edge("ok"), Edge("broken"), Edge("hung")
    broken.fail = ConnectionRefusedError("connection refused")
    hung.hang = True
    w = Watcher({"ok": ok, "broken": broken, "hung": hung}, timeout_s=0.2)
    assert [n.reason for n in w.nodes()] == ["not polled yet"] * 3

    await w.poll_once()
    by_id = {n.node_id: n for n in w.nodes()}
    assert by_id["ok"].healthy and by_id["ok"].reason is None
    assert not by_id["broken"].healthy
    assert "ConnectionRefusedError" in by_id["broken"].reason
    assert not by_id["hung"].healthy and "no status within 0.2s" in by_id["hung"].reason


async def test_polls_concurrently():
    edges = {f"n{i}": Edge(f"n{i}", delay_s=0.2) for i in range(20)}
    w = Watcher(edges, timeout_s=1.0)
    t0 = time.monotonic()
    await w.poll_once()
    assert time.monotonic() - t0 < 1.0   # sequential would take 4 s
    assert all(n.healthy for n in w.nodes())


async def test_failed_node_keeps_last_capacity_and_recovers():
    e = Edge("a")
    e.sandboxes = 7
    w = Watcher({"a": e}, timeout_s=0.2)
    await w.poll_once()
    e.fail = RuntimeError("disk on fire")
    await w.poll_once()
    n = w.node("a")
    assert not n.healthy and "disk on fire" in n.reason
    assert n.capacity.max_sandboxes == 100 and n.sandboxes == 7
    e.fail = None
    e.sandboxes = 8
    await w.poll_once()
    assert w.node("a").healthy and w.node("a").sandboxes == 8


async def test_edge_answering_for_another_node_is_unhealthy():
    w = Watcher({"a": Edge("b")})
    await w.poll_once()
    assert not w.node("a").healthy and "'b'" in w.node("a").reason


async def test_start_polls_in_background_and_stop_cancels():
    e = Edge("a")
    w = Watcher({"a": e}, interval_s=0.02)
    await w.start()
    assert w.node("a").healthy            # first poll done before start() returns
    e.sandboxes = 3
    for _ in range(100):
        await asyncio.sleep(0.02)
        if w.node("a").sandboxes == 3:
            break
    assert w.node("a").sandboxes == 3
    task = w._task
    await w.stop()
    assert task.done()
    polls = e.polls
    await asyncio.sleep(0.1)
    assert e.polls == polls               # nothing left running
    await w.stop()                        # idempotent


async def test_stop_while_a_poll_hangs():
    e = Edge("a")
    w = Watcher({"a": e}, interval_s=0.01, timeout_s=30)
    await w.start()
    e.hang = True
    await asyncio.sleep(0.05)             # the loop is now stuck in a 30 s poll
    await asyncio.wait_for(w.stop(), 1.0)


async def test_add_and_remove_edges_while_running():
    w = Watcher({"a": Edge("a")}, interval_s=0.02)
    async with w:
        w.add_edge("b", Edge("b"))
        assert not w.node("b").healthy and w.node("b").reason == "not polled yet"
        for _ in range(100):
            await asyncio.sleep(0.02)
            if w.node("b").healthy:
                break
        assert w.node("b").healthy
        w.remove_edge("a")
        assert [n.node_id for n in w.nodes()] == ["b"] and w.node("a") is None


async def test_edge_removed_during_poll_is_not_resurrected():
    slow = Edge("a", delay_s=0.2)
    w = Watcher({"a": slow})
    poll = asyncio.create_task(w.poll_once())
    await asyncio.sleep(0.05)
    w.remove_edge("a")
    await poll
    assert w.nodes() == []


@pytest.mark.parametrize("exc", [OSError("boom"), ValueError("bad json"), TimeoutError()])
async def test_any_edge_exception_is_contained(exc):
    e = Edge("a")
    e.fail = exc
    w = Watcher({"a": e})
    await w.poll_once()
    assert not w.node("a").healthy
