"""A one-way send told to be patient waits out a broker that cannot take a publish (a restart), and
gives up with the broker's error after its bound; an impatient one fails at once. Before, the
controller's ``Run`` to an agent failed on the first closed channel and ended the run (exit 3)."""

from __future__ import annotations

import pytest
from parkway.actors.runtime import client as client_module
from parkway.actors.runtime.client import Client
from parkway.brokers.base import BrokerError, Delivery, Envelope, Lane
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Probe

from tests.support.waiting import until

RUN = "send-retry"


class DownFor(MemoryBroker):
    """A broker whose first ``failures`` publishes fail as a closed channel does."""

    def __init__(self, hub: MemoryHub, run: str, failures: int) -> None:
        super().__init__(hub, run)
        self.failures = failures

    async def publish(self, address: str, envelope: Envelope, *, lane: Lane = Lane.DATA) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise BrokerError(f"publish to {address!r} failed: <Channel: '1'> closed")
        await super().publish(address, envelope, lane=lane)


@pytest.fixture(autouse=True)
def quick_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "SEND_RETRY_FIRST_S", 0.001)


async def test_a_patient_send_waits_out_the_outage_and_arrives_once() -> None:
    hub = MemoryHub()
    async with DownFor(hub, RUN, failures=3) as broker:
        await broker.declare("agent/0")
        sender = Client(broker, secret=b"s", sender="controller/0")
        probe = Probe(checkpoint_id="ck-1", deadline=2e9)
        await sender.send("agent/0", probe, correlation_id="ck-1", retry_for_s=30)
        assert broker.failures == 0
        received: list[Delivery] = []

        async def take(delivery: Delivery) -> None:
            received.append(delivery)
            await delivery.ack()

        consumer = await broker.consume("agent/0", take, lane=Lane.CONTROL)  # a Probe: a control command
        await until(lambda: bool(received), timeout=5)
        await consumer.cancel()
        assert len(received) == 1  # sent once, after three refusals
        assert received[0].envelope.correlation_id == "ck-1"


async def test_an_impatient_send_and_one_past_its_bound_raise_the_brokers_error() -> None:
    hub = MemoryHub()
    async with DownFor(hub, RUN, failures=10**6) as broker:
        await broker.declare("agent/0")
        sender = Client(broker, secret=b"s", sender="controller/0")
        probe = Probe(checkpoint_id="ck-1", deadline=2e9)
        with pytest.raises(BrokerError, match="closed"):
            await sender.send("agent/0", probe, correlation_id="ck-1")
        before = broker.failures
        with pytest.raises(BrokerError, match="closed"):
            await sender.send("agent/0", probe, correlation_id="ck-1", retry_for_s=0.05)
        assert before - broker.failures > 1  # it did try again before giving up


async def test_a_correlation_id_longer_than_amqp_carries_is_a_typed_refusal_not_a_transport_error() -> None:
    from parkway.protocol.errors import ErrorCode, ProtocolError

    async with MemoryBroker(MemoryHub(), "unit") as broker:
        sender = Client(broker, secret=b"s" * 32, sender="controller/0")
        with pytest.raises(ProtocolError) as refused:
            sender.envelope(Probe(checkpoint_id="p-1", deadline=1e10), correlation_id="x" * 256, to="tq/0")
    assert refused.value.code is ErrorCode.INVALID_MESSAGE and "255 bytes" in refused.value.detail
