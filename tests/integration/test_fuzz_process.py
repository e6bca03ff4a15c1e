"""Thousands of hostile messages over the real RabbitMQ at an actor in its own process.

Every message must be settled (handled, or refused with a dead letter), the process must be the
same one at the end, and the refusals must equal the dead letters.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import uuid
from pathlib import Path

import pika
import pytest
from hypothesis import HealthCheck, given, settings
from parkway.actors.client import Client
from parkway.brokers.rabbitmq import RabbitBroker

from tests.conftest import AMQP_URL, delete_run, rabbitmq_reachable
from tests.fuzz import REFUSALS, Fuzzed, fuzzed
from tests.integration.processes import SECRET, ActorProcess, status_of, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

EXAMPLES = int(os.environ.get("PARKWAY_FUZZ_EXAMPLES", "2000"))


class Target:
    def __init__(self, root: Path) -> None:
        assert rabbitmq_reachable(), f"RabbitMQ is not reachable at {AMQP_URL}"
        self.run = f"fz{uuid.uuid4().hex[:8]}"
        self.actor = ActorProcess("resources", 0, AMQP_URL, self.run, root).start()
        self.runner = asyncio.Runner()
        self.broker = RabbitBroker(AMQP_URL, self.run)
        self.runner.run(self.broker.start())
        self.client = Client(self.broker, secret=SECRET.encode(), sender="controller/0")
        self.ready = self.runner.run(wait_ready(self.client, self.actor))
        self.connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
        self.channel = self.connection.channel()
        self.sent = 0

    def send(self, item: Fuzzed) -> None:
        headers = {"x-parkway-sender": "fuzz/0"}
        if item.signed:
            facts = "\n".join(("parkway-v1", self.run, "fuzz/0", item.correlation_id, item.content_type))
            headers["x-parkway-signature"] = hmac.new(
                SECRET.encode(), facts.encode() + b"\n" + item.body, hashlib.sha256
            ).hexdigest()
        self.channel.basic_publish(
            exchange=f"pk.{self.run}",
            routing_key="resources/0",
            body=item.body,
            properties=pika.BasicProperties(
                content_type=item.content_type or None, correlation_id=item.correlation_id, headers=headers
            ),
        )
        self.sent += 1

    def close(self) -> None:
        self.connection.close()
        self.actor.kill()
        self.runner.run(self.broker.close())
        self.runner.run(delete_run(AMQP_URL, self.run, ["resources/0"]))
        self.runner.close()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    t = Target(tmp_path_factory.mktemp("fuzz-process"))
    yield t
    t.close()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(item=fuzzed())
def test_publish_fuzzed_messages(target: Target, item: Fuzzed) -> None:
    target.send(item)


def test_the_process_survived_and_settled_every_message(target: Target) -> None:
    async def settle() -> tuple[int, int, dict[str, int]]:
        queue_name = f"pk.{target.run}.q.resources/0"
        channel = await target.broker._connection.channel()  # type: ignore[union-attr]
        async with asyncio.timeout(120):
            while True:
                depth = (
                    await channel.declare_queue(queue_name, passive=True)
                ).declaration_result.message_count
                status = await status_of(target.client, "resources/0")
                if depth == 0 and status.in_flight == 0:
                    break
                await asyncio.sleep(0.2)
        await channel.close()
        letters = await target.broker.read_dead_letters(limit=1_000_000)
        return status.pid, len(letters), status.counts

    pid, dead, counts = target.runner.run(settle())
    refused = sum(counts.get(k, 0) for k in REFUSALS)
    assert target.sent == EXAMPLES
    assert pid == target.actor.pid and target.actor.proc.poll() is None  # the same process, still up
    assert dead == refused
    assert counts.get("refused:internal", 0) == 0
    assert refused > target.sent * 0.3 and target.sent - refused > target.sent * 0.1
