"""The connection to one of several RabbitMQ nodes of a cluster, and failing over between them.

``connect_first`` connects to the first node of the list that answers. ``NodeFailover`` watches the
robust connection: aio-pika reconnects a lost connection to the URL it holds, again and again; while the
connection stays down, every ``FAILOVER_AFTER_S`` the watcher points that URL at the next node of the
list (round the list), so the next attempt goes there.
"""

from __future__ import annotations

import asyncio
import time

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractRobustConnection
from parkway.brokers.base import BrokerError
from parkway.brokers.urls import redact_url
from yarl import URL

log = structlog.get_logger("parkway.broker")

FAILOVER_AFTER_S = 1.0  # down this long on one node: the next attempt goes to the next node
CONNECT_RETRY_FIRST_S, CONNECT_RETRY_MAX_S = 0.25, 2.0  # a first connection's pauses, when asked to wait
RECONNECT_INTERVAL_S = 0.5  # aio-pika's pause between attempts (recovers in ~0.2 s instead of ~2 s)


async def connect_first(
    urls: list[str], connection_name: str, *, wait_s: float = 0.0
) -> tuple[AbstractRobustConnection, str]:
    """A robust connection to the first of ``urls`` that answers, and that URL. With ``wait_s``, a
    broker that is not up (restarting, or starting beside this process) is tried again, the pause
    doubling from ``CONNECT_RETRY_FIRST_S`` to ``CONNECT_RETRY_MAX_S``, for that long."""
    deadline = time.monotonic() + wait_s
    pause = CONNECT_RETRY_FIRST_S
    while True:
        problems = []
        for url in urls:
            try:
                connection = await aio_pika.connect_robust(
                    url,
                    reconnect_interval=RECONNECT_INTERVAL_S,
                    client_properties={"connection_name": connection_name},
                )
            except (OSError, aiormq.exceptions.AMQPError) as exc:
                problems.append(f"{redact_url(url)}: {exc}")
                continue
            return connection, url
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BrokerError(f"cannot connect to {'; '.join(problems)}")
        log.warning("broker_unreachable", problems=problems, retry_in_s=round(min(pause, remaining), 3))
        await asyncio.sleep(min(pause, remaining))
        pause = min(pause * 2, CONNECT_RETRY_MAX_S)


class NodeFailover:
    """Moves a down connection's next attempt along the node list. ``url`` is the node it is on (or
    tries next); ``failovers`` counts the moves."""

    def __init__(self, connection: AbstractRobustConnection, urls: list[str], url: str) -> None:
        self.connection, self.urls, self.url = connection, urls, url
        self.failovers = 0
        self._task: asyncio.Task[None] | None = None
        if len(urls) > 1:
            self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while not self.connection.is_closed:
            await asyncio.sleep(FAILOVER_AFTER_S)
            if self.connection.connected.is_set():
                continue
            self.url = self.urls[(self.urls.index(self.url) + 1) % len(self.urls)]
            self.connection.url = URL(self.url)  # type: ignore[attr-defined]  # each attempt reads it
            self.failovers += 1
            log.warning("broker_failover", node=redact_url(self.url))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
