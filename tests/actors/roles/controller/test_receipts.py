"""Receipts of attempts the controller never dispatched (in memory; the process test is
``tests/integration/test_receipts_process.py``): acknowledged to the replica the receipt names, and a
receipt naming a replica that does not exist holds up no other agent's Ack."""

from __future__ import annotations

from parkway.actors.roles.controller import Controller
from parkway.actors.runtime.client import Client
from parkway.brokers.base import Delivery
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Ack, Failed

from tests.support.waiting import until

SECRET = b"receipts-test"


async def test_unknown_receipts_are_acked_to_their_sender_and_a_bad_replica_blocks_nobody() -> None:
    async with MemoryBroker(MemoryHub(), "rc") as broker:
        controller = Controller(broker, secret=SECRET)
        await controller.start()
        client = Client(broker, secret=SECRET, sender="agent/0")
        acks: list[Ack] = []

        async def on_ack(delivery: Delivery) -> None:
            message = client.open(delivery.envelope)
            assert isinstance(message, Ack)
            acks.append(message)
            await delivery.ack()

        await broker.declare("agent/0")
        await broker.consume("agent/0", on_ack)
        for rollout, replica in (("ghost_g0", 7), ("forged_g0", 0)):  # agent/7 has no queue at all
            receipt = Failed(rollout_id=rollout, attempt=0, code="unknown_env", replica=replica, epoch=1)
            await client.send("controller/0", receipt, correlation_id=rollout)
        await until(lambda: len(acks) == 1, timeout=10)
        counts = dict(controller.counts)
        await controller.stop()
    assert [(r.rollout_id, r.attempt) for r in acks[0].receipts] == [("forged_g0", 0)]
    assert counts["receipts_unknown"] == 2 and counts["acks_unknown_sent"] == 1, counts
    assert counts.get("attempts_failed", 0) == 0 and counts.get("acks_sent", 0) == 0, counts


async def test_a_restored_controller_refuses_a_receipt_of_the_timeline_before_it() -> None:
    async with MemoryBroker(MemoryHub(), "re") as broker:
        controller = Controller(broker, secret=SECRET)
        controller.state.epoch = 2  # what a restore of an epoch-1 snapshot makes it
        await controller.start()
        client = Client(broker, secret=SECRET, sender="agent/0")
        for epoch in (1, 2):
            receipt = Failed(rollout_id=f"r{epoch}_g0", attempt=0, code="garbage", replica=0, epoch=epoch)
            await client.send("controller/0", receipt, correlation_id=f"r{epoch}")
        await until(
            lambda: controller.counts["Failed"] == 1 and controller.counts["refused:stale_epoch"] == 1
        )
        letters = await broker.read_dead_letters()
        await controller.stop()
    assert [(x.origin, x.code) for x in letters] == [("controller/0", "stale_epoch")]
