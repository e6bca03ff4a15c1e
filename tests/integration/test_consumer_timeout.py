"""A delivery unacknowledged past RabbitMQ's ``consumer_timeout``, on a throwaway node this test owns
(issue 14): a command is acked only after its reply, so a generation longer than the timeout (30 min by
default; 2 s here) makes RabbitMQ close the consumer's channel and requeue the command while its handler
still runs. The consumer must come back, and the redelivered command must be answered once from the
reply cache: executed once, one reply, nothing lost.

RabbitMQ 3.10 has no per-queue consumer timeout (``x-consumer-timeout`` came in 3.12): the node-wide
``consumer_timeout`` is set here, and ``channel_tick_interval`` (how often a channel checks it) lowered.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from parkway.actors.launch.rabbit_node import RabbitNode, rabbitmq_bin
from parkway.actors.runtime.client import Client
from parkway.brokers.rabbitmq import RabbitBroker
from parkway.protocol.messages import Probe, ProbeResult

from tests.support.processes import SECRET, start_actor_process, status_of, wait_ready

pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.slow,
    pytest.mark.skipif(rabbitmq_bin() is None, reason="needs the scripts of a local RabbitMQ installation"),
]

CONSUMER_TIMEOUT_MS = 2000


@pytest.fixture
def node() -> Iterator[RabbitNode]:
    with RabbitNode("parkway-consumer-timeout-test") as started:
        started.set_env("consumer_timeout", CONSUMER_TIMEOUT_MS)
        started.set_env("channel_tick_interval", 200)
        yield started


def probe_lines(state_root: Path, checkpoint_id: str) -> list[str]:
    return [
        line
        for log in (state_root / "state").rglob("probe.log")
        for line in log.read_text().splitlines()
        if line.split()[0] == checkpoint_id
    ]


async def test_a_command_outlasting_the_consumer_timeout_is_answered_once(
    node: RabbitNode, tmp_path: Path
) -> None:
    run = "ctimeout"
    actor = start_actor_process("resources", 0, node.url, run, tmp_path / "state")
    try:
        async with RabbitBroker(node.url, run) as broker:
            client = Client(broker, secret=SECRET.encode(), sender="controller/0")
            await wait_ready(client, actor)
            long = Probe(
                checkpoint_id="long", deadline=time.time() + 90, work_s=3 * CONSUMER_TIMEOUT_MS / 1000
            )
            reply = await client.request("resources/0", long)
            assert isinstance(reply, ProbeResult) and reply.executions == 1

            # The channel was closed under the running handler and the command redelivered: it was
            # answered from the reply cache, not run again, and the requester got one reply.
            counts = (await status_of(client, "resources/0")).counts
            assert counts.get("Probe") == 1 and counts.get("replayed", 0) >= 1, counts
            assert probe_lines(tmp_path, "long") == [f"long {actor.pid}"]
            # The consumer is back: new commands are delivered and answered.
            for n in range(3):
                again = await client.request(
                    "resources/0", Probe(checkpoint_id=f"next-{n}", deadline=time.time() + 30)
                )
                assert isinstance(again, ProbeResult) and again.executions == 1
            await status_of(client, "resources/0")  # a later round trip: a second reply would be here by now
            assert (broker.duplicate_replies, broker.late_replies) == (0, 0)
            assert actor.alive()
    finally:
        actor.stop()
