"""The RabbitMQ transport on a real three-node cluster started on this machine
(``actors/launch/rabbit_cluster.py``), with quorum queues: command queues are quorum queues and the log
stream a stream; a request and its reply cross nodes; messages published survive the node they were
published through going down; a client whose node stops fails over to the next of its URL list and
goes on; a poison message (requeued past the delivery limit) ends in the dead-letter queue, not in a
loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from parkway.actors.launch.rabbit_cluster import RabbitCluster
from parkway.actors.launch.rabbit_node import rabbitmq_bin
from parkway.brokers.base import REQUEST_ID_HEADER, Delivery, Envelope
from parkway.brokers.rabbitmq import RabbitBroker
from parkway.brokers.rabbitmq_layout import QueueKind

from tests.support.waiting import until

pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.slow,  # three broker nodes started and clustered: about 20 s
    pytest.mark.skipif(rabbitmq_bin() is None, reason="needs the scripts of a local RabbitMQ installation"),
]
QUORUM = QueueKind(type="quorum", delivery_limit=2)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RabbitCluster]:
    with RabbitCluster("parkway-cluster-test") as started:
        yield started


@pytest.fixture
def all_up(cluster: RabbitCluster) -> Iterator[RabbitCluster]:
    yield cluster
    for index, node in enumerate(cluster.nodes):  # a test that stopped a node leaves it running again
        if node.name not in cluster.running_nodes(via=(index + 1) % len(cluster.nodes)):
            cluster.start_node(index)


def envelope(body: bytes) -> Envelope:
    return Envelope(
        body=body, content_type="text/plain", correlation_id=f"c-{body.decode()}", persistent=True
    )


def queue_types(cluster: RabbitCluster, run: str) -> dict[str, str]:
    listed = cluster.nodes[0].ctl("list_queues", "name", "type", "--quiet", "--no-table-headers")
    assert listed.returncode == 0, listed.stderr
    rows = (line.split() for line in listed.stdout.splitlines())
    return {name: kind for name, kind in rows if name.startswith(f"pk.{run}.")}


async def echo_server(server: RabbitBroker, address: str) -> None:
    await server.declare(address)

    async def echo(delivery: Delivery) -> None:
        reply = Envelope(
            b"re:" + delivery.envelope.body,
            "text/plain",
            delivery.envelope.correlation_id,
            {REQUEST_ID_HEADER: delivery.envelope.headers[REQUEST_ID_HEADER]},
        )
        assert delivery.envelope.reply_to
        await server.reply(delivery.envelope.reply_to, reply)
        await delivery.ack()

    await server.consume(address, echo, prefetch=8)


async def test_quorum_queues_and_requests_across_nodes(all_up: RabbitCluster, run_name: str) -> None:
    urls = all_up.urls
    async with (
        RabbitBroker(urls[1], run_name, queue_kind=QUORUM) as server,
        RabbitBroker(urls[0], run_name, queue_kind=QUORUM) as client,
    ):
        await echo_server(server, "echo/0")
        far = time.time() + 60
        answer = await client.request("echo/0", envelope(b"hello"), deadline=far)
        assert answer.body == b"re:hello"  # the reply went from node 1 back to the requester on node 0
    types = queue_types(all_up, run_name)
    assert types[f"pk.{run_name}.q.echo/0"] == types[f"pk.{run_name}.c.echo/0"] == "quorum"
    assert types[f"pk.{run_name}.dead"] == "quorum" and types[f"pk.{run_name}.logs"] == "stream"


async def test_messages_survive_their_node_and_a_client_fails_over(
    all_up: RabbitCluster, run_name: str
) -> None:
    urls = all_up.urls
    # The publisher is on node 2, which then stops; its URL list goes on to node 0.
    publisher = RabbitBroker(",".join([urls[2], urls[0]]), run_name, queue_kind=QUORUM)
    await publisher.start()
    try:
        await publisher.declare("sink/0")
        for index in range(20):
            await publisher.publish("sink/0", envelope(f"m{index}".encode()))  # confirmed by a majority
        await asyncio.to_thread(all_up.stop_node, 2)
        await until(lambda: publisher.failovers > 0 and publisher.url == urls[0], timeout=30)
        async with RabbitBroker(urls[1], run_name, queue_kind=QUORUM) as server:
            await echo_server(server, "echo/0")
            # After the failover the publisher's requests are answered again (through node 0).
            deadline = time.time() + 60
            reply = await asyncio.wait_for(
                retry_request(publisher, "echo/0", envelope(b"after"), deadline), timeout=60
            )
            assert reply.body == b"re:after"
            got: list[bytes] = []

            async def take(delivery: Delivery) -> None:
                got.append(delivery.envelope.body)
                await delivery.ack()

            await server.consume("sink/0", take, prefetch=32)
            await until(lambda: len(got) >= 20, timeout=30)
        assert sorted(got) == sorted(f"m{index}".encode() for index in range(20))  # none lost, none twice
    finally:
        await publisher.close()


async def retry_request(broker: RabbitBroker, address: str, message: Envelope, deadline: float) -> Envelope:
    """A request, tried again while the reconnected channel is not ready to take it yet."""
    while True:
        try:
            return await broker.request(address, message, deadline=min(deadline, time.time() + 5))
        except Exception:
            if time.time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_a_poison_message_is_dead_lettered_after_the_delivery_limit(
    all_up: RabbitCluster, run_name: str
) -> None:
    async with RabbitBroker(all_up.urls[0], run_name, queue_kind=QUORUM) as broker:
        await broker.declare("poisoned/0")
        taken: list[bool] = []

        async def crash(delivery: Delivery) -> None:
            taken.append(delivery.redelivered)
            await delivery.nack(requeue=True)  # as a consumer that dies of it: given back each time

        await broker.publish("poisoned/0", envelope(b"poison"))
        await broker.consume("poisoned/0", crash, prefetch=1)

        async def dead() -> list:
            seen, _ = await broker.peek_dead_letters()
            return [d for d in seen if d.envelope.body == b"poison"]

        deadline = time.monotonic() + 30
        while not await dead():
            assert time.monotonic() < deadline, f"not dead-lettered after {len(taken)} deliveries"
            await asyncio.sleep(0.1)
    assert len(taken) == QUORUM.delivery_limit + 1  # the first delivery and the limit's redeliveries
