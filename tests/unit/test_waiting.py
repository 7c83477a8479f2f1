"""The tests' one wait helper (dsec.testing.waiting): polls plain and async probes, returns the
first truthy answer, and at the deadline either names what it waited for or hands back the last
answer."""

from __future__ import annotations

import pytest

from dsec.testing.waiting import wait_until, wait_until_sync


async def test_returns_the_first_truthy_answer_of_a_plain_or_async_probe() -> None:
    answers = iter([0, "", "ready"])
    assert await wait_until(lambda: next(answers), every_s=0) == "ready"
    calls = []

    async def probe() -> int:
        calls.append(1)
        return len(calls) if len(calls) >= 3 else 0
    assert await wait_until(probe, every_s=0) == 3


async def test_at_the_deadline_it_names_what_it_waited_for_or_gives_the_last_answer() -> None:
    with pytest.raises(AssertionError, match="waiting for the pool to refill .last: 0."):
        await wait_until(lambda: 0, timeout_s=0.05, every_s=0.01, what="the pool to refill")
    assert await wait_until(lambda: [], timeout_s=0.05, every_s=0.01) == []
    assert wait_until_sync(lambda: None, timeout_s=0.05, every_s=0.01) is None
    with pytest.raises(AssertionError, match="the file"):
        wait_until_sync(lambda: False, timeout_s=0.05, every_s=0.01, what="the file")
