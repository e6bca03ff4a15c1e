"""Replies go only to reply addresses, over the real broker with live actor processes (issue 21): a
``reply_to`` naming another actor's command queue made the actor post its reply there, where that actor
refused it and dead-lettered it again: two dead letters for one message, and work for a bystander."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
from parkway.actors.runtime.client import Client
from parkway.brokers.base import Envelope
from parkway.protocol.messages import Probe, ProbeResult

from tests.support.processes import status_of, wait_ready
from tests.support.waiting import until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


def probe_lines(state_root: Path, checkpoint_id: str) -> list[str]:
    return [
        line
        for log in (state_root / "state").rglob("probe.log")
        for line in log.read_text().splitlines()
        if line.split()[0] == checkpoint_id
    ]


async def test_a_reply_to_naming_a_command_queue_gets_no_reply(
    spawn, client: Client, run_name: str, tmp_path: Path
) -> None:
    target, bystander = spawn("resources"), spawn("tq")
    await wait_ready(client, target)
    await wait_ready(client, bystander)
    await client.broker.read_dead_letters()  # start from an empty dead-letter queue
    hijacked = f"pk.{run_name}.q.tq/0"  # tq's command queue, as a reply address

    probe = client.envelope(
        Probe(checkpoint_id="aimed", deadline=time.time() + 60), correlation_id="aimed", to="resources/0"
    )
    await client.broker.publish("resources/0", replace(probe, reply_to=hijacked))
    garbage = Envelope(b"\xc1unsigned, not msgpack", "application/msgpack", "junk-1", reply_to=hijacked)
    await client.broker.publish("resources/0", garbage)

    async def target_done() -> bool:
        counts = (await status_of(client, "resources/0")).counts
        return counts.get("Probe", 0) == 1 and counts.get("refused:unauthorized", 0) == 1

    give_up = time.time() + 30
    while not await target_done():
        assert time.time() < give_up, "resources/0 did not handle both messages"
        await asyncio.sleep(0.05)
    assert probe_lines(tmp_path, "aimed") != []  # the Probe ran (answered once: to nobody)

    await status_of(client, "tq/0")  # tq's queue is in order: anything posted there came before this
    tq = await status_of(client, "tq/0")
    assert {k: v for k, v in tq.counts.items() if k.startswith("refused:")} == {}
    letters = await client.broker.read_dead_letters()
    assert [(d.origin, d.code, d.envelope.correlation_id) for d in letters] == [
        ("resources/0", "unauthorized", "junk-1")
    ]
    target_counts = (await status_of(client, "resources/0")).counts
    assert target_counts.get("reply_refused") == 2
    await until(lambda: len(probe_lines(tmp_path, "aimed")) == 1, timeout=5)


# A direct reply-to address RabbitMQ made on another node (taken from a throwaway node's log): on 3.10,
# publishing to it closes the publishing connection with INTERNAL_ERROR.
FOREIGN_REPLY_TO = (
    "amq.rabbitmq.reply-to.g1h2AA5yZXBseUAxMzU3ODAyMAAAAt0AAAAAaw+log==.eP7lc4rdpfsQmhOGaht9bw=="
)


async def test_a_reply_address_of_another_node_does_not_take_the_actor_down_again_and_again(
    spawn, client: Client, tmp_path: Path
) -> None:
    target = spawn("resources")
    await wait_ready(client, target)
    probe = client.envelope(
        Probe(checkpoint_id="foreign", deadline=time.time() + 120), correlation_id="foreign", to="resources/0"
    )
    await client.broker.publish("resources/0", replace(probe, reply_to=FOREIGN_REPLY_TO))
    await until(lambda: bool(probe_lines(tmp_path, "foreign")), timeout=30)

    async def settled() -> dict[str, int]:
        counts = (await status_of(client, "resources/0", timeout=30)).counts
        return counts if counts.get("reply_refused", 0) >= 1 or counts.get("reply_failed", 0) >= 3 else {}

    give_up = time.time() + 90
    while not (counts := await settled()):
        assert time.time() < give_up, "resources/0 neither refused nor failed the reply"
        await asyncio.sleep(0.2)
    # One connection lost over it, and the redelivery (if any) not replied to: no loop of reconnects.
    assert counts.get("reply_failed", 0) == 0 and counts.get("replayed", 0) <= 1, counts
    assert counts["Probe"] == 1 and len(probe_lines(tmp_path, "foreign")) == 1
    probe = Probe(checkpoint_id="after-foreign", deadline=time.time() + 30)
    assert isinstance(await client.request("resources/0", probe), ProbeResult)
    assert target.alive()
