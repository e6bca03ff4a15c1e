"""The RabbitMQ transport (aio-pika), with the semantics documented in ``base``.

Per run ``R`` it declares, all durable:

- exchange ``pk.R`` (direct): routes a message to the queue of its address; queues are ``pk.R.q.<address>``
  and dead-letter (expired or rejected messages) to ``pk.R.dlx``;
- exchange ``pk.R.dlx`` (fanout) -> queue ``pk.R.dead``: the run's dead-letter queue;
- exchange ``pk.R.logs`` (fanout) -> stream ``pk.R.logs``: every actor's log lines, readable from the start.

Requests use direct reply-to on one channel; each consumer gets a channel of its own, so cancelling
one closes its channel and RabbitMQ requeues exactly its unsettled deliveries.

A lost connection (a broker restart) is reopened by aio-pika, consumers included; the direct reply-to
consumer is not one aio-pika restores, so this broker consumes it again on every reopen of its channel,
and no request is published before it does (RabbitMQ refuses a request whose reply-to nobody consumes,
"fast reply consumer does not exist", and closes the channel). A reply address dies with its channel:
requests still waiting when the channel closes fail at once with ``BrokerError`` instead of waiting
for a reply that can no longer come.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

import aio_pika
import aiormq
import anyio
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
    FieldValue,
    HeadersType,
)
from parkway.brokers.base import (
    Broker,
    BrokerError,
    Consumer,
    DeadLetter,
    Delivery,
    DeliveryHandler,
    Envelope,
    Unroutable,
    as_dead_letter,
    dead_letter_headers,
)
from parkway.brokers.urls import redact_url

DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"
_CHANNEL_GONE = (aiormq.exceptions.AMQPError, aio_pika.exceptions.ChannelInvalidStateError, RuntimeError)
_TRANSPORT_ERRORS = (
    aiormq.exceptions.AMQPError,
    aio_pika.exceptions.ChannelInvalidStateError,
    ConnectionError,
)
LOG_STREAM_MAX_BYTES = 256 * 1024 * 1024
REPLIES_READY_TIMEOUT_S = 30.0  # how long a request waits for a reopened channel's reply consumer


def _envelope(message: AbstractIncomingMessage) -> Envelope:
    headers = {
        str(k): v.decode() if isinstance(v, bytes) else str(v) for k, v in (message.headers or {}).items()
    }
    return Envelope(
        body=message.body,
        content_type=message.content_type or "",
        correlation_id=message.correlation_id or "",
        headers=headers,
        reply_to=message.reply_to,
        persistent=message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT,
    )


def _message(envelope: Envelope) -> aio_pika.Message:
    return aio_pika.Message(
        body=envelope.body,
        content_type=envelope.content_type or None,
        correlation_id=envelope.correlation_id,
        headers=dict(envelope.headers),
        reply_to=envelope.reply_to,
        delivery_mode=(
            aio_pika.DeliveryMode.PERSISTENT if envelope.persistent else aio_pika.DeliveryMode.NOT_PERSISTENT
        ),
    )


class _RabbitDelivery(Delivery):
    def __init__(self, message: AbstractIncomingMessage, address: str) -> None:
        super().__init__(_envelope(message), address=address, redelivered=bool(message.redelivered))
        self._message = message

    async def _ack(self) -> None:
        # If the channel is gone, RabbitMQ redelivers the message and the reply cache absorbs it.
        with contextlib.suppress(*_CHANNEL_GONE):
            await self._message.ack()

    async def _nack(self, requeue: bool) -> None:
        with contextlib.suppress(*_CHANNEL_GONE):
            await self._message.nack(requeue=requeue)


class _RabbitConsumer(Consumer):
    def __init__(self, handler: DeliveryHandler, channel: AbstractChannel, address: str) -> None:
        super().__init__(handler)
        self.channel = channel
        self.address = address

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        self.offer(_RabbitDelivery(message, self.address))

    async def _close_transport(self) -> None:
        if not self.channel.is_closed:
            await self.channel.close()


class RabbitBroker(Broker):
    def __init__(self, url: str, run: str, *, connection_name: str | None = None) -> None:
        super().__init__(run)
        self.url = url
        self.connection_name = connection_name or f"parkway-{run}-{os.getpid()}"
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._dlx: AbstractExchange | None = None
        self._logs: AbstractExchange | None = None
        self._dead_queue: AbstractQueue | None = None
        self.reply_address = DIRECT_REPLY_TO
        self._consumers: list[_RabbitConsumer] = []
        self._declared: set[str] = set()
        self._replies_ready = asyncio.Event()  # the direct reply-to consumer runs on the channel

    # -- names ---------------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"pk.{self.run}"

    def queue_name(self, address: str) -> str:
        return f"{self.prefix}.q.{address}"

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            self._connection = await aio_pika.connect_robust(
                self.url, reconnect_interval=0.5, client_properties={"connection_name": self.connection_name}
            )
        except (OSError, aiormq.exceptions.AMQPError) as exc:
            raise BrokerError(f"cannot connect to {redact_url(self.url)}: {exc}") from exc
        self._connection.reconnect_callbacks.add(self._on_reconnect)
        channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        self._channel = channel
        self._exchange = await channel.declare_exchange(
            self.prefix, aio_pika.ExchangeType.DIRECT, durable=True
        )
        self._dlx = await channel.declare_exchange(
            f"{self.prefix}.dlx", aio_pika.ExchangeType.FANOUT, durable=True
        )
        self._dead_queue = await channel.declare_queue(f"{self.prefix}.dead", durable=True)
        await self._dead_queue.bind(self._dlx)
        self._logs = await channel.declare_exchange(
            f"{self.prefix}.logs", aio_pika.ExchangeType.FANOUT, durable=True
        )
        log_stream = await channel.declare_queue(
            f"{self.prefix}.logs",
            durable=True,
            arguments={"x-queue-type": "stream", "x-max-length-bytes": LOG_STREAM_MAX_BYTES},
        )
        await log_stream.bind(self._logs)
        # Direct reply-to: consume the pseudo-queue without acks on the channel that publishes requests,
        # again each time the channel is reopened (aio-pika does not restore this consumer).
        channel.close_callbacks.add(self._on_channel_closed)
        channel.reopen_callbacks.add(self._on_channel_reopened)
        await self._consume_replies()

    async def _consume_replies(self) -> None:
        assert self._channel is not None
        reply_queue = await self._channel.get_queue(DIRECT_REPLY_TO, ensure=False)
        await reply_queue.consume(self._on_reply, no_ack=True)
        self._replies_ready.set()

    def _on_channel_closed(self, *_: Any) -> None:
        self._replies_ready.clear()
        self._pending.fail_all(
            BrokerError("the broker connection was lost: a reply to this request can no longer arrive")
        )

    async def _on_channel_reopened(self, *_: Any) -> None:
        await self._consume_replies()

    def _on_reconnect(self, *_: Any) -> None:
        self.reconnects += 1

    async def close(self) -> None:
        for consumer in list(self._consumers):
            await consumer.cancel()
        self._consumers.clear()
        self._pending.fail_all(ConnectionError("broker connection closed"))
        if self._connection is not None and not self._connection.is_closed:
            await self._connection.close()

    # -- publishing ----------------------------------------------------------------------------
    async def declare(self, address: str) -> None:
        if address in self._declared:
            return
        assert self._channel is not None and self._exchange is not None, "broker not started"
        queue = await self._channel.declare_queue(
            self.queue_name(address),
            durable=True,
            arguments={"x-dead-letter-exchange": f"{self.prefix}.dlx"},
        )
        await queue.bind(self._exchange, routing_key=address)
        self._declared.add(address)

    async def publish(self, address: str, envelope: Envelope) -> None:
        assert self._exchange is not None, "broker not started"
        if envelope.reply_to == DIRECT_REPLY_TO and not self._replies_ready.is_set():
            try:  # the channel was reopened and does not consume its replies yet
                with anyio.fail_after(REPLIES_READY_TIMEOUT_S):
                    await self._replies_ready.wait()
            except TimeoutError:
                raise BrokerError(
                    f"request to {address!r} not sent: no reply consumer after {REPLIES_READY_TIMEOUT_S:.0f}s"
                ) from None
        try:
            await self._exchange.publish(_message(envelope), routing_key=address, mandatory=True)
        except aio_pika.exceptions.DeliveryError as exc:
            raise Unroutable(f"no queue for address {address!r} in run {self.run!r}") from exc
        except (
            aiormq.exceptions.AMQPError,
            aio_pika.exceptions.ChannelInvalidStateError,
            ConnectionError,
        ) as exc:
            raise BrokerError(f"publish to {address!r} failed: {exc}") from exc

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        self._pending.deliver(_envelope(message))

    async def reply(self, reply_to: str, envelope: Envelope) -> None:
        assert self._channel is not None, "broker not started"
        try:
            # Replies go through the default exchange; mandatory=False, as direct reply-to requires.
            await self._channel.default_exchange.publish(
                _message(envelope), routing_key=reply_to, mandatory=False
            )
        except (
            aiormq.exceptions.AMQPError,
            aio_pika.exceptions.ChannelInvalidStateError,
            ConnectionError,
        ) as exc:
            raise BrokerError(f"reply to {reply_to!r} failed: {exc}") from exc

    # -- consuming -----------------------------------------------------------------------------
    async def consume(self, address: str, handler: DeliveryHandler, *, prefetch: int = 16) -> Consumer:
        assert self._connection is not None, "broker not started"
        channel = await self._connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=prefetch)
        try:
            queue = await channel.declare_queue(self.queue_name(address), passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            raise Unroutable(f"no queue for address {address!r} in run {self.run!r}") from exc
        consumer = _RabbitConsumer(handler, channel, address)
        await queue.consume(consumer.on_message, no_ack=False)
        self._consumers.append(consumer)
        return consumer

    async def dead_letter(self, delivery: Delivery, *, code: str, detail: str) -> None:
        assert self._dlx is not None, "broker not started"
        envelope = delivery.envelope
        headers = dead_letter_headers(envelope, origin=delivery.address, code=code, detail=detail)
        await self._dlx.publish(_message(replace(envelope, headers=headers, persistent=True)), routing_key="")
        await delivery.ack()

    async def read_dead_letters(self, limit: int = 1000) -> list[DeadLetter]:
        assert self._dead_queue is not None, "broker not started"
        taken: list[DeadLetter] = []
        while len(taken) < limit:
            message = await self._dead_queue.get(no_ack=False, fail=False)
            if message is None:
                break
            taken.append(as_dead_letter(_envelope(message)))
            await message.ack()
        return taken

    # -- logs ----------------------------------------------------------------------------------
    async def publish_log(self, line: bytes, *, checkpoint_id: str | None) -> None:
        assert self._logs is not None, "broker not started"
        headers: HeadersType = {"checkpoint_id": checkpoint_id} if checkpoint_id else {}
        message = aio_pika.Message(
            line,
            content_type="application/json",
            headers=headers,
            delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
        )
        await self._logs.publish(message, routing_key="")

    async def follow_logs(
        self, *, from_start: bool = True, since: float | None = None
    ) -> AsyncGenerator[bytes, None]:
        assert self._connection is not None, "broker not started"
        channel = await self._connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=1000)  # streams require a prefetch limit
        queue = await channel.declare_queue(f"{self.prefix}.logs", passive=True)
        lines: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_line(message: AbstractIncomingMessage) -> None:
            lines.put_nowait(message.body)
            await message.ack()

        offset: FieldValue = "first" if from_start else "next"
        if from_start and since is not None:
            offset = datetime.datetime.fromtimestamp(since, datetime.UTC)  # an AMQP timestamp: seek by time
        await queue.consume(on_line, no_ack=False, arguments={"x-stream-offset": offset})
        try:
            while True:
                yield await lines.get()
        finally:
            if not channel.is_closed:
                await channel.close()
