"""A lost broker connection, on the real RabbitMQ: requests work again after the reconnect, and a
request whose reply died with the old connection fails at once instead of waiting for its deadline.

Found by ``parkway chaos`` (a broker restart): aio-pika restores consumers after a reconnect, but not
the direct reply-to consumer, so every request after a broker restart was refused by RabbitMQ ("fast
reply consumer does not exist") until the process restarted; and an agent's model call waiting when the
broker went down waited its whole 600 s deadline for a reply that could no longer arrive.

The connection is closed with ``rabbitmqctl close_connection``: only this test's own connection, by its
name, so other tests on the same broker are not touched.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid

import pytest
from parkway.brokers.base import REQUEST_ID_HEADER, BrokerError, Delivery, Envelope, RequestTimeout
from parkway.brokers.rabbitmq import RabbitBroker

from tests.support.rabbit import connection_pid, delete_run
from tests.support.waiting import until

pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.slow,  # rabbitmqctl, a separate process, closes the connection
    pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl of the local RabbitMQ"),
]


def envelope(body: bytes) -> Envelope:
    return Envelope(body=body, content_type="text/plain", correlation_id=f"c-{body.decode()}")


async def test_requests_survive_a_lost_connection(amqp_url: str, run_name: str) -> None:
    name = f"parkway-test-{uuid.uuid4().hex[:8]}"
    held: list[Delivery] = []
    try:
        async with (
            RabbitBroker(amqp_url, run_name) as server,
            RabbitBroker(amqp_url, run_name, connection_name=name) as client,
        ):
            await server.declare("echo/0")

            async def echo(d: Delivery) -> None:
                if d.envelope.body == b"hold":
                    held.append(d)  # never answered: its reply would go to the lost connection anyway
                    return
                reply = Envelope(
                    b"re:" + d.envelope.body,
                    "text/plain",
                    d.envelope.correlation_id,
                    {REQUEST_ID_HEADER: d.envelope.headers[REQUEST_ID_HEADER]},
                )
                assert d.envelope.reply_to
                await server.reply(d.envelope.reply_to, reply)
                await d.ack()

            await server.consume("echo/0", echo, prefetch=8)
            far = time.time() + 600
            assert (await client.request("echo/0", envelope(b"before"), deadline=far)).body == b"re:before"

            waiting = asyncio.ensure_future(client.request("echo/0", envelope(b"hold"), deadline=far))
            await until(lambda: bool(held), timeout=10)
            pid = await asyncio.to_thread(connection_pid, name)
            assert pid is not None, f"no connection named {name}"
            await asyncio.to_thread(
                subprocess.run,
                ["rabbitmqctl", "close_connection", pid, "test: a lost connection"],
                capture_output=True,
                timeout=30,
                check=True,
            )
            async with asyncio.timeout(60):  # a bound for the test, far below the request's deadline
                with pytest.raises(BrokerError) as failed:
                    await waiting
            assert not isinstance(failed.value, RequestTimeout)
            assert "can no longer arrive" in str(failed.value)

            await until(lambda: client.reconnects >= 1, timeout=30, poll=0.05)
            after = await client.request("echo/0", envelope(b"after"), deadline=time.time() + 30)
            assert after.body == b"re:after"
    finally:
        await delete_run(amqp_url, run_name, ["echo/0"])
