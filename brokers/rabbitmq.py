"""The RabbitMQ transport (aio-pika), with the semantics documented in ``base``.

Per run ``R`` it declares, all durable:

- exchange ``pk.R`` (direct): routes a message of the data lane to its address's queue
  ``pk.R.q.<address>`` (the routing key is the address);
- exchange ``pk.R.control`` (direct): the same for the control lane, to ``pk.R.c.<address>``, a queue
  of its own so that a control command never waits behind the data queued before it. An exchange of
  its own rather than a marked routing key on ``pk.R``, so that both lanes route by the address as it
  is. ``declare`` makes both queues of an address; both dead-letter (expired or rejected messages) to
  ``pk.R.dlx``;
- exchange ``pk.R.dlx`` (fanout) -> queue ``pk.R.dead``: the run's dead-letter queue, bounded by
  ``x-max-length`` and ``x-message-ttl`` with ``x-overflow: reject-publish``: a full queue nacks the
  publish (confirms are on), so the actor knows the dead letter was dropped and counts it. RabbitMQ
  refuses to redeclare a queue with other arguments (``PRECONDITION_FAILED``): a queue declared before
  (older parkway, other bounds) is used as it is, ``dead_letter_bounds_applied`` is False, and
  ``parkway dead-letters purge --recreate`` makes it anew with the configured bounds;
- exchange ``pk.R.logs`` (fanout) -> stream ``pk.R.logs``: every actor's log lines, readable from the start.

Queue types (``QueueKind``, from ``PARKWAY_QUEUE_TYPE``): ``classic`` (the default: one node holds each
queue) or ``quorum`` for a cluster: every command queue and the dead-letter queue is a quorum queue,
replicated on a majority of the nodes, so a node lost takes no message with it. A quorum command queue
dead-letters a message redelivered more than ``PARKWAY_DELIVERY_LIMIT`` times (a poison message that
kills whoever takes it is set aside, not retried forever) and dead-letters at least once
(``x-dead-letter-strategy``): a dead letter is moved only once the dead-letter queue has confirmed it.
The log stream is a stream either way (streams replicate by themselves).

Several nodes: ``url`` may list several, comma-separated (``PARKWAY_BROKER_URL``). The connection is
made to the first that answers, in order; when it is lost, aio-pika reconnects, and while it stays down
each attempt after the first goes to the next node of the list (``rabbitmq_nodes.py``). Names
and queue kinds: ``rabbitmq_layout.py``.

Requests use direct reply-to on one channel; each consumer (one per lane an actor consumes) gets a
channel of its own, so cancelling one closes its channel and RabbitMQ requeues exactly its unsettled
deliveries, and a data consumer whose prefetch is full holds up no control command.

A lost connection (a broker restart) is reopened by aio-pika, consumers included; the direct reply-to
consumer is not one aio-pika restores, so this broker consumes it again on every reopen of its channel,
and no request is published before it does (RabbitMQ refuses a request whose reply-to nobody consumes,
"fast reply consumer does not exist", and closes the channel). A reply address dies with its channel:
requests still waiting when the channel closes fail at once with ``BrokerError`` instead of waiting
for a reply that can no longer come.

Replies are published on a channel of their own, with confirms, so a reply that fails (the connection
is down, the channel was closed) is known: it is tried again on a fresh channel, a bounded number of
times, before ``reply`` raises ``BrokerError`` (the actor then leaves the delivery for redelivery and
its reply cache answers the redelivery). Replies go only to direct reply-to addresses
(``amq.rabbitmq.reply-to.*``) or server-named queues (``amq.gen-*``): names no client can declare, so
never another actor's command queue. A direct reply-to address RabbitMQ cannot resolve (one of another
node, or forged) makes RabbitMQ 3.10 close the whole connection with ``INTERNAL_ERROR``: such an address
is remembered and never published to again (``UnreachableReplyAddress``), so one hostile message takes
the connection down once, not on every redelivery.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import os
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

import aio_pika
import aiormq
import anyio
import structlog
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
    DeadLetterBounds,
    Delivery,
    DeliveryHandler,
    Envelope,
    Lane,
    UnreachableReplyAddress,
    Unroutable,
    as_dead_letter,
    dead_letter_headers,
)
from parkway.brokers.rabbitmq_layout import (
    LOG_STREAM_MAX_BYTES,
    QueueKind,
    exchange_name,
    queue_name,
    run_prefix,
    split_urls,
)
from parkway.brokers.rabbitmq_nodes import NodeFailover, connect_first

log = structlog.get_logger("parkway.broker")

DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"
# What RabbitMQ makes for a requester: direct reply-to names and server-named queues. No client may
# declare a queue whose name starts with "amq.", so these are never an actor's command queue.
REPLY_ADDRESS_PREFIXES = (f"{DIRECT_REPLY_TO}.", "amq.gen-")
REPLY_ATTEMPTS = 6  # tries of one reply before it is left to the redelivery
REPLY_RETRY_S = 0.25  # the first pause between tries; it doubles each time (0.25 s .. 4 s, ~8 s in all)
REPLY_TRY_TIMEOUT_S = 10.0  # one try: waiting for the connection, opening a channel, the confirm
REPLY_ADDRESSES_KEPT = 10_000  # reply addresses remembered as good, and as refused
_CHANNEL_GONE = (aiormq.exceptions.AMQPError, aio_pika.exceptions.ChannelInvalidStateError, RuntimeError)
_TRANSPORT_ERRORS = (
    aiormq.exceptions.AMQPError,
    aio_pika.exceptions.ChannelInvalidStateError,
    ConnectionError,
)
REPLIES_READY_TIMEOUT_S = 30.0  # how long a request waits for a reopened channel's reply consumer


def _remember(addresses: collections.OrderedDict[str, None], address: str) -> None:
    addresses[address] = None
    addresses.move_to_end(address)
    if len(addresses) > REPLY_ADDRESSES_KEPT:
        addresses.popitem(last=False)


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
    def __init__(self, message: AbstractIncomingMessage, address: str, lane: Lane) -> None:
        super().__init__(
            _envelope(message), address=address, redelivered=bool(message.redelivered), lane=lane
        )
        self._message = message

    async def _ack(self) -> None:
        # If the channel is gone, RabbitMQ redelivers the message and the reply cache absorbs it.
        with contextlib.suppress(*_CHANNEL_GONE):
            await self._message.ack()

    async def _nack(self, requeue: bool) -> None:
        with contextlib.suppress(*_CHANNEL_GONE):
            await self._message.nack(requeue=requeue)


class _RabbitConsumer(Consumer):
    def __init__(self, handler: DeliveryHandler, channel: AbstractChannel, address: str, lane: Lane) -> None:
        super().__init__(handler)
        self.channel = channel
        self.address = address
        self.lane = lane

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        self.offer(_RabbitDelivery(message, self.address, self.lane))

    async def _close_transport(self) -> None:
        if not self.channel.is_closed:
            await self.channel.close()


class RabbitBroker(Broker):
    def __init__(
        self,
        url: str,
        run: str,
        *,
        connection_name: str | None = None,
        dead_letter_bounds: DeadLetterBounds | None = None,
        queue_kind: QueueKind | None = None,
        connect_wait_s: float = 0.0,
    ) -> None:
        super().__init__(run, dead_letter_bounds=dead_letter_bounds)
        self.connect_wait_s = connect_wait_s  # how long ``start`` waits for a broker that is not up
        self.urls = split_urls(url)
        self.queue_kind = queue_kind or QueueKind.from_env()
        self._failover: NodeFailover | None = None
        self.connection_name = connection_name or f"parkway-{run}-{os.getpid()}"
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchanges: dict[Lane, AbstractExchange] = {}  # each lane's, once started
        self._dlx: AbstractExchange | None = None
        self._logs: AbstractExchange | None = None
        self._dead_queue: AbstractQueue | None = None
        self.reply_address = DIRECT_REPLY_TO
        self._consumers: list[_RabbitConsumer] = []
        self._declared: set[str] = set()
        self._replies_ready = asyncio.Event()  # the direct reply-to consumer runs on the channel
        self._reply_channel: AbstractChannel | None = None  # replies to others' requests go out here
        self._reply_channel_lock = asyncio.Lock()
        self._refused_reply_addresses: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._good_reply_addresses: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._reply_exclusive = asyncio.Lock()
        self._replies_publishing = 0
        self._replies_idle = asyncio.Event()

    @property
    def url(self) -> str:
        """The node connected to (or tried next)."""
        return self._failover.url if self._failover is not None else self.urls[0]

    @property
    def failovers(self) -> int:
        """Times a lost connection was tried on another node."""
        return self._failover.failovers if self._failover is not None else 0

    # -- names ---------------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return run_prefix(self.run)

    def queue_name(self, address: str, lane: Lane = Lane.DATA) -> str:
        return queue_name(self.run, address, lane)

    @property
    def dead_queue_name(self) -> str:
        return f"{self.prefix}.dead"

    def dead_queue_arguments(self) -> dict[str, FieldValue]:
        arguments: dict[str, FieldValue] = {
            "x-max-length": self.dead_letter_bounds.max_length,
            "x-message-ttl": int(self.dead_letter_bounds.max_age_s * 1000),
            "x-overflow": "reject-publish",
        }
        if self.queue_kind.type == "quorum":
            arguments["x-queue-type"] = "quorum"
        return arguments

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._connection, url = await connect_first(
            self.urls, self.connection_name, wait_s=self.connect_wait_s
        )
        self._connection.reconnect_callbacks.add(self._on_reconnect)
        self._failover = NodeFailover(self._connection, self.urls, url)
        channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        self._channel = channel
        for lane in Lane:
            self._exchanges[lane] = await channel.declare_exchange(
                exchange_name(self.run, lane), aio_pika.ExchangeType.DIRECT, durable=True
            )
        self._dlx = await channel.declare_exchange(
            f"{self.prefix}.dlx", aio_pika.ExchangeType.FANOUT, durable=True
        )
        self.dead_letter_bounds_applied = await self._declare_dead_queue()
        self._dead_queue = await channel.declare_queue(self.dead_queue_name, passive=True)
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

    async def _declare_dead_queue(self) -> bool:
        """Declare the dead-letter queue with the bounds, on a channel of its own: a queue that exists
        with other arguments fails the declaration and closes that channel. False in that case."""
        assert self._connection is not None
        channel = await self._connection.channel()
        try:
            await channel.declare_queue(
                self.dead_queue_name, durable=True, arguments=self.dead_queue_arguments()
            )
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            log.warning(
                "dead_letter_queue_kept",
                queue=self.dead_queue_name,
                detail=str(exc),
                remedy="parkway dead-letters purge --recreate",
            )
            return False
        finally:
            if not channel.is_closed:
                await channel.close()
        return True

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
        if self._failover is not None:
            self._failover.stop()
        for consumer in list(self._consumers):
            await consumer.cancel()
        self._consumers.clear()
        self._pending.fail_all(ConnectionError("broker connection closed"))
        if self._reply_channel is not None and not self._reply_channel.is_closed:
            with contextlib.suppress(*_CHANNEL_GONE, asyncio.CancelledError):
                await self._reply_channel.close()
        if self._connection is not None and not self._connection.is_closed:
            await self._connection.close()

    # -- publishing ----------------------------------------------------------------------------
    async def declare(self, address: str) -> None:
        if address in self._declared:
            return
        assert self._channel is not None and self._exchanges, "broker not started"
        for lane in Lane:
            try:
                queue = await self._channel.declare_queue(
                    self.queue_name(address, lane),
                    durable=True,
                    arguments=self.queue_kind.command_queue_arguments(f"{self.prefix}.dlx"),
                )
            except aiormq.exceptions.ChannelPreconditionFailed as exc:
                raise BrokerError(
                    f"queue {self.queue_name(address, lane)} exists with other settings than a "
                    f"{self.queue_kind.type} queue's (declared by another configuration of run {self.run!r}): "
                    f"{exc}"
                ) from None
            await queue.bind(self._exchanges[lane], routing_key=address)
        self._declared.add(address)

    async def publish(self, address: str, envelope: Envelope, *, lane: Lane = Lane.DATA) -> None:
        assert self._exchanges, "broker not started"
        if envelope.reply_to == DIRECT_REPLY_TO and not self._replies_ready.is_set():
            try:  # the channel was reopened and does not consume its replies yet
                with anyio.fail_after(REPLIES_READY_TIMEOUT_S):
                    await self._replies_ready.wait()
            except TimeoutError:
                raise BrokerError(
                    f"request to {address!r} not sent: no reply consumer after {REPLIES_READY_TIMEOUT_S:.0f}s"
                ) from None
        try:
            await self._exchanges[lane].publish(_message(envelope), routing_key=address, mandatory=True)
        except aio_pika.exceptions.DeliveryError as exc:
            raise Unroutable(f"no {lane} queue for address {address!r} in run {self.run!r}") from exc
        except (
            aiormq.exceptions.AMQPError,
            aio_pika.exceptions.ChannelInvalidStateError,
            ConnectionError,
        ) as exc:
            raise BrokerError(f"publish to {address!r} failed: {exc}") from exc

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        self._pending.deliver(_envelope(message))

    def is_reply_address(self, reply_to: str) -> bool:
        return reply_to.startswith(REPLY_ADDRESS_PREFIXES) and reply_to not in self._refused_reply_addresses

    async def reply(self, reply_to: str, envelope: Envelope) -> None:
        assert self._connection is not None, "broker not started"
        pause = REPLY_RETRY_S
        for attempt in range(1, REPLY_ATTEMPTS + 1):
            known = reply_to in self._good_reply_addresses
            try:
                async with self._reply_slot(exclusive=not known):
                    with anyio.fail_after(REPLY_TRY_TIMEOUT_S):
                        channel = await self._open_reply_channel()
                        # The default exchange; mandatory=False, as direct reply-to requires.
                        await channel.default_exchange.publish(
                            _message(envelope), routing_key=reply_to, mandatory=False
                        )
                _remember(self._good_reply_addresses, reply_to)
                return
            except (*_TRANSPORT_ERRORS, RuntimeError, TimeoutError) as exc:
                await self._drop_reply_channel()
                # Published alone (a first reply to this address): the connection died of this address.
                if not known and isinstance(exc, aiormq.exceptions.ConnectionInternalError):
                    _remember(self._refused_reply_addresses, reply_to)
                    raise UnreachableReplyAddress(
                        f"reply to {reply_to!r}: the broker closed the connection over it ({exc!r})"
                    ) from exc
                if attempt == REPLY_ATTEMPTS:
                    raise BrokerError(f"reply to {reply_to!r} failed after {attempt} tries: {exc!r}") from exc
                self.reply_retries += 1
                log.info("reply_retry", attempt=attempt, error=repr(exc))
            await asyncio.sleep(pause)
            pause *= 2

    @contextlib.asynccontextmanager
    async def _reply_slot(self, *, exclusive: bool) -> AsyncIterator[None]:
        """Replies to known addresses go out side by side; the first reply to a new address goes out
        alone, so that a connection RabbitMQ closes over it is blamed on that address only."""
        async with self._reply_exclusive:
            if exclusive:
                while self._replies_publishing:
                    await self._replies_idle.wait()
                yield
                return
            self._replies_publishing += 1
            self._replies_idle.clear()
        try:
            yield
        finally:
            self._replies_publishing -= 1
            if not self._replies_publishing:
                self._replies_idle.set()

    async def _open_reply_channel(self) -> AbstractChannel:
        """The reply channel, opened anew when there is none or it was closed (once the connection is
        back, after a broker restart)."""
        assert self._connection is not None
        async with self._reply_channel_lock:
            channel = self._reply_channel
            if channel is not None and not channel.is_closed:
                return channel
            await self._connection.connected.wait()
            channel = await self._connection.channel(publisher_confirms=True)
            self._reply_channel = channel
            return channel

    async def _drop_reply_channel(self) -> None:
        channel, self._reply_channel = self._reply_channel, None
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(*_CHANNEL_GONE, TimeoutError):
                with anyio.fail_after(REPLY_TRY_TIMEOUT_S):
                    await channel.close()

    # -- consuming -----------------------------------------------------------------------------
    async def consume(
        self, address: str, handler: DeliveryHandler, *, prefetch: int = 16, lane: Lane = Lane.DATA
    ) -> Consumer:
        assert self._connection is not None, "broker not started"
        channel = await self._connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=prefetch)
        try:
            queue = await channel.declare_queue(self.queue_name(address, lane), passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            raise Unroutable(f"no {lane} queue for address {address!r} in run {self.run!r}") from exc
        consumer = _RabbitConsumer(handler, channel, address, lane)
        await queue.consume(consumer.on_message, no_ack=False)
        self._consumers.append(consumer)
        return consumer

    async def dead_letter(self, delivery: Delivery, *, code: str, detail: str) -> bool:
        assert self._dlx is not None, "broker not started"
        envelope = delivery.envelope
        headers = dead_letter_headers(envelope, origin=delivery.address, code=code, detail=detail)
        message = _message(replace(envelope, headers=headers, persistent=True))
        try:
            await self._dlx.publish(message, routing_key="")
            kept = True
        except aio_pika.exceptions.DeliveryError:  # nacked: the bounded queue is full (reject-publish)
            self.dead_letters_dropped += 1
            kept = False
        except _TRANSPORT_ERRORS as exc:
            raise BrokerError(f"dead letter from {delivery.address!r} not sent: {exc!r}") from exc
        await delivery.ack()
        return kept

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

    async def peek_dead_letters(self, limit: int = 100) -> tuple[list[DeadLetter], int]:
        assert self._connection is not None, "broker not started"
        # Got unacked on a channel of their own, then handed back in one go when it closes: each
        # message is seen once, and all of them are still in the queue afterwards (marked redelivered).
        channel = await self._connection.channel()
        try:
            queue = await channel.declare_queue(self.dead_queue_name, passive=True)
            held = int(queue.declaration_result.message_count or 0)
            seen: list[DeadLetter] = []
            while len(seen) < limit:
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    break
                seen.append(as_dead_letter(_envelope(message)))
        finally:
            await channel.close()
        return seen, held

    async def purge_dead_letters(self, *, recreate: bool = False) -> int:
        assert self._connection is not None and self._dlx is not None, "broker not started"
        channel = await self._connection.channel()
        try:
            queue = await channel.declare_queue(self.dead_queue_name, passive=True)
            held = int(queue.declaration_result.message_count or 0)
            if not recreate:
                await queue.purge()
                return held
            await queue.delete(if_unused=False, if_empty=False)
            queue = await channel.declare_queue(
                self.dead_queue_name, durable=True, arguments=self.dead_queue_arguments()
            )
            await queue.bind(f"{self.prefix}.dlx")
            self.dead_letter_bounds_applied = True
            return held
        finally:
            if not channel.is_closed:
                await channel.close()

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
