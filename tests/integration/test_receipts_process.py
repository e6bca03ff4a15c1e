"""Receipts of attempts no controller dispatched (issue 21, hole 3), over the real RabbitMQ with a real
``parkway actor agent`` process: a running controller answers them, and an agent nobody answers backs
off and gives the receipt up after its bound instead of filling the controller's queue forever."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from parkway.actors.runtime.client import Client
from parkway.protocol.messages import Run

from tests.support.processes import Process, status_of, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

RESENDS = 4  # the agent's bound in these tests: resends before it gives a receipt up
FAST_RESEND = {"PARKWAY_RECEIPT_RESEND_S": "0.05", "PARKWAY_RECEIPT_RESEND_MAX_S": "0.2"}


def unknown_env_run(rollout: str) -> Run:
    """A signed Run no controller dispatched, for an environment nobody has: the agent fails it at once."""
    return Run(rollout_id=rollout, attempt=0, group_id="g-forged", env="no_such_env", prompt="x", epoch=1)


async def queued(client: Client, address: str) -> int:
    """How many messages wait in ``address``'s durable queue."""
    channel = await client.broker._connection.channel()  # type: ignore[attr-defined]
    try:
        queue = await channel.declare_queue(client.broker.queue_name(address), passive=True)  # type: ignore[attr-defined]
        return int(queue.declaration_result.message_count or 0)
    finally:
        await channel.close()


async def agent_counts(client: Client, until_done: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """The agent's counts once ``until_done`` holds for them (polled; the agent is another process)."""
    async with asyncio.timeout(60):
        while True:
            counts = (await status_of(client, "agent/0")).counts
            if until_done(counts):
                return counts
            await asyncio.sleep(0.05)


async def test_an_unanswered_receipt_is_resent_with_a_bound_then_given_up(
    spawn: Callable[..., Process], client: Client
) -> None:
    await client.broker.declare("controller/0")  # the controller's queue, with nobody consuming it
    agent = spawn("agent", PARKWAY_RECEIPT_RESENDS=str(RESENDS), **FAST_RESEND)
    await wait_ready(client, agent)
    await client.send("agent/0", unknown_env_run("forged_0"), correlation_id="forged_0")

    # Until the agent gives up, or resends past its bound (what an unbounded resender does).
    counts = await agent_counts(
        client, lambda c: c.get("receipts_given_up", 0) >= 1 or c.get("receipts_resent", 0) > RESENDS
    )
    assert counts.get("receipts_given_up", 0) == 1, counts
    assert counts["receipts_resent"] == RESENDS, counts
    assert await queued(client, "controller/0") == 1 + RESENDS  # the first send and each resend, no more
    assert agent.popen.poll() is None


async def test_a_running_controller_acknowledges_a_receipt_it_never_dispatched(
    spawn: Callable[..., Process], client: Client
) -> None:
    controller = spawn("controller")
    await wait_ready(client, controller)
    agent = spawn("agent", PARKWAY_RECEIPT_RESENDS="1000", **FAST_RESEND)
    await wait_ready(client, agent)
    await client.send("agent/0", unknown_env_run("forged_1"), correlation_id="forged_1")

    counts = await agent_counts(client, lambda c: c.get("receipts_acked", 0) >= 1)
    assert counts["receipts_acked"] == 1 and counts.get("receipts_given_up", 0) == 0, counts
    answered = (await status_of(client, "controller/0")).counts
    assert answered.get("receipts_unknown", 0) >= 1, answered
    assert answered.get("rollouts_sealed", 0) == 0 and answered.get("attempts_failed", 0) == 0, answered
