"""A process started while its broker is not up waits for it, on the real RabbitMQ.

Found by ``parkway chaos`` (CI's seeded schedule): a controller started again after a whole-cluster
kill, while the nemesis had the broker node down, exited at once (``cannot connect``), and the
harness counted an unplanned exit. Services and runs now try again, backing off, for
``PARKWAY_BROKER_WAIT_S`` (30 s). Here the broker's port is a forwarder that starts listening only
after the first tries were refused.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from urllib.parse import urlsplit

import pytest
import structlog
from parkway.brokers.base import BrokerError
from parkway.brokers.rabbitmq import RabbitBroker

from tests.support.rabbit import delete_run

pytestmark = [pytest.mark.rabbitmq]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def forward(port: int, target: tuple[str, int], after_s: float) -> asyncio.Server:
    """After ``after_s``, 127.0.0.1:``port`` forwards every connection to ``target``."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*target)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    await asyncio.sleep(after_s)
    return await asyncio.start_server(serve, "127.0.0.1", port)


async def test_a_broker_that_comes_up_late_is_waited_for(amqp_url: str) -> None:
    parts = urlsplit(amqp_url)
    port = free_port()
    late_url = amqp_url.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{port}")
    run = f"wait-{uuid.uuid4().hex[:8]}"
    server = asyncio.ensure_future(forward(port, (parts.hostname or "127.0.0.1", parts.port or 5672), 1.0))
    try:
        with structlog.testing.capture_logs() as logs:
            async with RabbitBroker(late_url, run, connect_wait_s=30.0) as broker:
                await broker.declare("agent/0")  # a working connection, through the forwarder
        refused = [e for e in logs if e["event"] == "broker_unreachable"]
        assert refused and all(e["retry_in_s"] <= 2.0 for e in refused)  # it was down, and waited
    finally:
        (await server).close()
        await delete_run(amqp_url, run, ["agent/0"])


async def test_without_a_wait_an_unreachable_broker_fails_at_once_and_with_one_it_gives_up(
    amqp_url: str,
) -> None:
    closed = f"amqp://guest:guest@127.0.0.1:{free_port()}/"
    with pytest.raises(BrokerError, match="cannot connect"):
        async with RabbitBroker(closed, "wait-none"):
            pass
    with structlog.testing.capture_logs() as logs, pytest.raises(BrokerError, match="cannot connect"):
        async with RabbitBroker(closed, "wait-some", connect_wait_s=0.6):
            pass
    assert len([e for e in logs if e["event"] == "broker_unreachable"]) >= 2  # tried again, then gave up
