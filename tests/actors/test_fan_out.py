"""``settle_all``: how the controller asks a stage's participants at once (anyio task group; one call in the
caller's own task)."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from parkway.actors.roles.controller.participants import settle_all


async def test_every_call_settles_in_order_and_a_failure_cancels_nothing() -> None:
    finished: list[str] = []

    async def slow(name: str) -> str:
        await anyio.sleep(0.05)
        finished.append(name)
        return name

    async def fails() -> str:
        raise ValueError("refused")

    results = await settle_all([lambda: slow("a"), fails, lambda: slow("c")])
    assert results[0] == "a" and results[2] == "c" and sorted(finished) == ["a", "c"]
    assert isinstance(results[1], ValueError) and str(results[1]) == "refused"
    assert await settle_all([]) == []


async def test_a_cancelled_caller_cancels_every_call() -> None:
    cancelled: list[str] = []

    async def waits(name: str) -> None:
        try:
            await anyio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    task = asyncio.ensure_future(settle_all([lambda: waits("a"), lambda: waits("b")]))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cancelled) == ["a", "b"]


async def test_one_call_runs_in_the_callers_task_and_settles_the_same() -> None:
    # A stage of one participant (TQ at capture) starts no task: no turn of the loop before it is sent.
    caller = asyncio.current_task()
    ran_in: list[asyncio.Task[object] | None] = []

    async def answers() -> str:
        ran_in.append(asyncio.current_task())
        return "ok"

    async def fails() -> str:
        raise ValueError("refused")

    assert await settle_all([answers]) == ["ok"] and ran_in == [caller]
    [failure] = await settle_all([fails])
    assert isinstance(failure, ValueError) and str(failure) == "refused"
