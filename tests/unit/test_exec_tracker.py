"""The edge's table of tracked execs: followers see everything from the start, concurrent
retries share one exec, and what finished execs hold stays bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from dsec.edge import exec_tracker
from dsec.edge.exec_tracker import ExecTable, TrackedExec
from dsec.types import ExecEvent, ExecInfo, ExecResult, InvalidArgument


def fake_exec(exec_id: str, chunks: list[str], gate: asyncio.Event | None = None):
    async def events(_: TrackedExec) -> AsyncIterator[ExecEvent]:
        yield ExecEvent(type="start", exec_id=exec_id)
        for c in chunks:
            yield ExecEvent(type="stdout", data=c)
            if gate is not None:
                await gate.wait()
        yield ExecEvent(type="exit", exec_id=exec_id,
                        result=ExecResult(exec_id=exec_id, exit_code=0, stdout="".join(chunks)))
    return events


async def collect(t: TrackedExec) -> str:
    return "".join([ev.data async for ev in t.follow() if ev.type == "stdout"])


async def test_late_and_concurrent_followers_get_all_output() -> None:
    table, gate = ExecTable(), asyncio.Event()
    t = table.start_tracking(ExecInfo(exec_id=""), None, fake_exec("1", ["a", "b", "c"], gate))
    await t.started.wait()
    table.register(t)
    early = asyncio.create_task(collect(t))
    await asyncio.sleep(0)
    gate.set()
    late = await collect(t)
    assert await early == late == "abc"
    assert (await t.wait_result()).stdout == "abc" and not t.info.running


async def test_a_key_whose_exec_never_started_is_free_again() -> None:
    table = ExecTable()

    async def refused(_: TrackedExec) -> AsyncIterator[ExecEvent]:
        raise InvalidArgument("no", field="cmd")
        yield ExecEvent(type="start")   # pragma: no cover

    t = table.start_tracking(ExecInfo(exec_id=""), "k", refused)
    await t.task
    assert t.error is not None and "k" not in table.by_key


async def test_finished_execs_are_bounded_by_count_and_bytes(monkeypatch) -> None:
    monkeypatch.setattr(exec_tracker, "KEEP_FINISHED_BYTES", 1000)
    table = ExecTable()
    for i in range(1, 8):
        t = table.start_tracking(ExecInfo(exec_id=""), f"k{i}", fake_exec(str(i), ["x" * 100]))
        await t.task
        table.register(t)
    table.prune()
    held = sum(t.kept_bytes for t in table.tracked.values())
    assert held <= 1000 and "7" in table.tracked and "1" not in table.tracked
    assert set(table.by_key) == {t.idempotency_key for t in table.tracked.values()}
    monkeypatch.setattr(exec_tracker, "KEEP_FINISHED", 2)
    table.prune()
    assert sorted(table.tracked) == ["6", "7"]


async def test_execs_keyed_by_the_sdk_are_kept_briefly_and_within_their_own_budget(monkeypatch) -> None:
    """Every run()/start() without a caller's key carries one the SDK made (for its resends):
    those results are kept SDK_KEEP_FINISHED_S and within SDK_KEEP_FINISHED_BYTES, so plain runs
    do not fill the sandbox's budget of results kept for callers' own keys."""
    from dsec.types import SDK_KEY_PREFIX
    monkeypatch.setattr(exec_tracker, "SDK_KEEP_FINISHED_BYTES", 500)
    table = ExecTable()
    for i, key in enumerate(["mine", *(f"{SDK_KEY_PREFIX}{i}" for i in range(6))], start=1):
        t = table.start_tracking(ExecInfo(exec_id=""), key, fake_exec(str(i), ["x" * 100]))
        await t.task
        table.register(t)
    table.prune()
    sdk = [t for t in table.tracked.values() if t.idempotency_key.startswith(SDK_KEY_PREFIX)]
    assert sum(t.kept_bytes for t in sdk) <= 500 and "7" in table.tracked and "2" not in table.tracked
    assert "1" in table.tracked                      # the caller's own key: not in that budget
    for t in table.tracked.values():                 # an SDK key's result ages out after a minute
        t.ended_at -= exec_tracker.SDK_KEEP_FINISHED_S + 1
    table.prune()
    assert list(table.tracked) == ["1"]


async def test_closing_from_a_tracked_exec_does_not_cancel_that_exec() -> None:
    """A tracked exec that finds its sandbox dead fails it, and the teardown closes the table: the
    exec's own task must finish that teardown, not be cancelled in the middle of it (a VM's
    files were left behind once every run() carried an SDK key)."""
    table = ExecTable()
    done: list[str] = []

    async def dies(_: TrackedExec) -> AsyncIterator[ExecEvent]:
        yield ExecEvent(type="start", exec_id="1")
        table.close()                  # what the teardown does, from this task
        await asyncio.sleep(0)         # the teardown's next await (destroying the sandbox)
        done.append("teardown")
        raise InvalidArgument("gone", field="cmd")

    other = table.start_tracking(ExecInfo(exec_id=""), "other", fake_exec("2", ["x"], asyncio.Event()))
    t = table.start_tracking(ExecInfo(exec_id=""), "k", dies)
    await asyncio.gather(t.task, other.task, return_exceptions=True)
    assert done == ["teardown"] and t.error is not None
    assert other.task.cancelled() or other.ended_at is not None


async def test_execs_cut_short_by_a_failed_sandbox_answer_its_failure() -> None:
    """The sandbox failed (its agent killed by the OOM killer) and another task tore it down: a
    keyed exec waiting on the tracker answers why, as an unkeyed one's own request did, not 'the
    exec ended without a result'."""
    table = ExecTable()
    t = table.start_tracking(ExecInfo(exec_id=""), "sdk-x", fake_exec("1", ["a", "b"], asyncio.Event()))
    await t.started.wait()
    table.close(InvalidArgument("sandbox sb-x failed: out of memory (memory_mb=32)", field="sandbox_id"))
    await asyncio.gather(t.task, return_exceptions=True)
    try:
        await t.wait_result()
    except InvalidArgument as e:
        assert "out of memory" in e.message
    else:
        raise AssertionError("no error")
