"""The real RabbitMQ the tests marked ``rabbitmq`` use: where it is, whether it answers, and clean-up of
what a test run declared on it."""

from __future__ import annotations

import os
import socket
import subprocess
from urllib.parse import urlparse

AMQP_URL = os.environ.get("PARKWAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
AMQP_PORT = urlparse(AMQP_URL).port or 5672


def rabbitmq_reachable() -> bool:
    parsed = urlparse(AMQP_URL)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 5672), timeout=1):
            return True
    except OSError:
        return False


async def delete_run(url: str, run: str, addresses: list[str]) -> None:
    """Remove a test run's queues (both lanes of each address) and exchanges from RabbitMQ."""
    import aio_pika
    from parkway.brokers.rabbitmq_layout import run_exchanges, run_queues

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        for name in run_queues(run, addresses):
            await channel.queue_delete(name)
        for name in run_exchanges(run):
            await channel.exchange_delete(name)


def connection_pid(name: str) -> str | None:
    """RabbitMQ's id of the client connection named ``name`` (its ``connection_name`` property), in the
    form ``close_connection`` takes (the table's, not the JSON formatter's)."""
    listing = subprocess.run(
        ["rabbitmqctl", "list_connections", "pid", "client_properties", "--quiet", "--no-table-headers"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    for line in listing.stdout.splitlines():
        pid, _, properties = line.partition("\t")
        if f'{{"connection_name","{name}"}}' in properties:
            return pid
    return None
