"""A few thousand hostile messages at one actor: each is answered or dead-lettered, none kills it."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from parkway.actors.client import Client
from parkway.actors.resources import Resources
from parkway.brokers.base import Envelope
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Status, StatusReport
from parkway.protocol.signing import SENDER_HEADER

from tests.actors.helpers import SECRET, signed_raw
from tests.fuzz import REFUSALS, Fuzzed, fuzzed

RUN = "fuzz"


class Harness:
    """One actor on one event loop that lives across all hypothesis examples."""

    def __init__(self, root: Path) -> None:
        self.runner = asyncio.Runner()
        self.hub = MemoryHub()
        self.sent = 0
        self.runner.run(self._start(root))

    async def _start(self, root: Path) -> None:
        self.broker = MemoryBroker(self.hub, RUN)
        await self.broker.start()
        self.actor = Resources(self.broker, secret=SECRET, snapshot_root=root)
        await self.actor.start()
        self.client = Client(self.broker, secret=SECRET, sender="test/0")

    def send(self, item: Fuzzed) -> None:
        async def go() -> None:
            if item.signed:
                envelope = signed_raw(
                    RUN, item.body, correlation_id=item.correlation_id, content_type=item.content_type
                )
            else:
                envelope = Envelope(item.body, item.content_type, item.correlation_id, {SENDER_HEADER: "x/1"})
            await self.broker.publish("resources/0", envelope)
            queue = self.hub.queues[(RUN, "resources/0")]
            while queue.messages or self.actor.in_flight:  # noqa: ASYNC110 - settle before the next one
                await asyncio.sleep(0)

        self.sent += 1
        self.runner.run(asyncio.wait_for(go(), 10))


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory):
    h = Harness(tmp_path_factory.mktemp("fuzz"))
    yield h
    h.runner.run(h.actor.stop())
    h.runner.close()


@settings(
    max_examples=int(os.environ.get("PARKWAY_FUZZ_EXAMPLES", "3000")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(item=fuzzed())
def test_every_fuzzed_message_is_settled(harness: Harness, item: Fuzzed) -> None:
    harness.send(item)


def test_the_actor_survived_and_accounted_for_everything(harness: Harness) -> None:
    async def check() -> tuple[StatusReport, int]:
        reply = await harness.client.request(
            "resources/0", Status(checkpoint_id="after", deadline=time.time() + 5)
        )
        assert isinstance(reply, StatusReport)
        letters = await harness.broker.read_dead_letters(limit=100_000)
        return reply, len(letters)

    status, dead = harness.runner.run(check())
    refused = sum(status.counts.get(k, 0) for k in REFUSALS)
    assert harness.sent >= 2000
    assert dead == refused  # every refusal was dead-lettered, and nothing else was
    assert status.counts.get("refused:internal", 0) == 0  # no input found a handler bug
    # The fuzz exercised both sides: plenty refused, and plenty valid enough to be handled.
    assert refused > harness.sent * 0.3
    assert harness.sent - refused > harness.sent * 0.1
