"""An in-memory broker with the same semantics as the RabbitMQ one, for unit tests and ``parkway up``.

``MemoryHub`` is the broker "server" (queues, the dead-letter queue, the log stream), shared by every
``MemoryBroker`` connection in the process. Each address has a queue per lane, keyed by (run, address,
lane), as RabbitMQ has two queues. A connection that closes, like a process that dies,
hands its unsettled deliveries back to their queues, marked redelivered.

Each run's dead-letter queue is bounded like the RabbitMQ one (``reject-publish``): a full queue refuses
a new dead letter (dropped, counted), and letters older than the age bound are gone. Replies go only to
reply addresses this hub made (``memory-reply/<n>``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

from parkway.brokers.base import (
    Broker,
    Consumer,
    DeadLetter,
    DeadLetterBounds,
    Delivery,
    DeliveryHandler,
    Envelope,
    Lane,
    Unroutable,
    as_dead_letter,
    dead_letter_headers,
)

LOG_STREAM_LIMIT = 100_000  # lines kept, oldest dropped first (a stream with a retention limit)
REPLY_PREFIX = "memory-reply/"


@dataclass
class _Queue:
    messages: collections.deque[tuple[Envelope, bool]] = field(default_factory=collections.deque)
    consumers: list[_MemoryConsumer] = field(default_factory=list)
    turn: int = 0  # round-robin position among consumers


QueueKey = tuple[str, str, Lane]  # (run, address, lane): one queue


class MemoryHub:
    """The shared state of an in-process broker."""

    def __init__(self) -> None:
        self.queues: dict[QueueKey, _Queue] = {}
        # Each run's dead letters, (time dead-lettered, message), and the bounds its queue was made with.
        self.dead: dict[str, collections.deque[tuple[float, Envelope]]] = collections.defaultdict(
            collections.deque
        )
        self.dead_bounds: dict[str, DeadLetterBounds] = {}
        # Each run's log stream: (time published, line).
        self.logs: dict[str, collections.deque[tuple[float, bytes]]] = collections.defaultdict(
            lambda: collections.deque(maxlen=LOG_STREAM_LIMIT)
        )
        self.log_followers: dict[str, set[asyncio.Queue[bytes]]] = collections.defaultdict(set)
        self.reply_sinks: dict[str, Broker] = {}
        self._ids = itertools.count()

    def next_id(self) -> int:
        return next(self._ids)

    def declare_dead(self, run: str, bounds: DeadLetterBounds) -> bool:
        """The run's dead-letter queue with ``bounds``; False when it exists with others (kept)."""
        return self.dead_bounds.setdefault(run, bounds) == bounds

    def live_dead(self, run: str) -> collections.deque[tuple[float, Envelope]]:
        """The run's dead letters, those past the age bound dropped first (as a message TTL does)."""
        dead = self.dead[run]
        bounds = self.dead_bounds.get(run)
        if bounds is not None:
            oldest = time.time() - bounds.max_age_s
            while dead and dead[0][0] < oldest:
                dead.popleft()
        return dead

    def enqueue(self, key: QueueKey, envelope: Envelope, *, redelivered: bool = False) -> None:
        queue = self.queues.get(key)
        if queue is None:
            raise Unroutable(unroutable_detail(key))
        queue.messages.append((envelope, redelivered))
        self.pump(queue)

    def requeue_front(self, key: QueueKey, envelopes: list[Envelope]) -> None:
        queue = self.queues.get(key)
        if queue is None:
            return
        for envelope in reversed(envelopes):
            queue.messages.appendleft((envelope, True))
        self.pump(queue)

    def pump(self, queue: _Queue) -> None:
        """Hand queued messages to consumers with free prefetch, round-robin."""
        while queue.messages:
            ready = [c for c in queue.consumers if c.has_capacity()]
            if not ready:
                return
            consumer = ready[queue.turn % len(ready)]
            queue.turn += 1
            envelope, redelivered = queue.messages.popleft()
            consumer.deliver(envelope, redelivered)


def unroutable_detail(key: QueueKey) -> str:
    run, address, lane = key
    return f"no {lane} queue for address {address!r} in run {run!r}"


class _MemoryDelivery(Delivery):
    def __init__(self, consumer: _MemoryConsumer, envelope: Envelope, redelivered: bool) -> None:
        super().__init__(envelope, address=consumer.address, redelivered=redelivered, lane=consumer.lane)
        self._consumer = consumer

    async def _ack(self) -> None:
        self._consumer.settle(self, requeue=False)

    async def _nack(self, requeue: bool) -> None:
        self._consumer.settle(self, requeue=requeue)


class _MemoryConsumer(Consumer):
    def __init__(self, hub: MemoryHub, key: QueueKey, handler: DeliveryHandler, prefetch: int):
        super().__init__(handler)
        self.hub, self.key, self.prefetch = hub, key, prefetch
        _, self.address, self.lane = key
        self.unacked: list[_MemoryDelivery] = []

    def has_capacity(self) -> bool:
        return not self._closed and len(self.unacked) < self.prefetch

    def deliver(self, envelope: Envelope, redelivered: bool) -> None:
        delivery = _MemoryDelivery(self, envelope, redelivered)
        self.unacked.append(delivery)
        self.offer(delivery)

    def settle(self, delivery: _MemoryDelivery, *, requeue: bool) -> None:
        if delivery in self.unacked:
            self.unacked.remove(delivery)
        if requeue:
            self.hub.requeue_front(self.key, [delivery.envelope])
        else:
            queue = self.hub.queues.get(self.key)
            if queue is not None:
                self.hub.pump(queue)

    async def _close_transport(self) -> None:
        queue = self.hub.queues.get(self.key)
        if queue is not None and self in queue.consumers:
            queue.consumers.remove(self)
        pending, self.unacked = [d for d in self.unacked if not d.settled], []
        for delivery in pending:
            delivery.settled = True
        self.hub.requeue_front(self.key, [d.envelope for d in pending])


class MemoryBroker(Broker):
    """One connection to a ``MemoryHub``."""

    def __init__(
        self, hub: MemoryHub, run: str, *, dead_letter_bounds: DeadLetterBounds | None = None
    ) -> None:
        super().__init__(run, dead_letter_bounds=dead_letter_bounds)
        self.hub = hub
        self.reply_address = f"{REPLY_PREFIX}{hub.next_id()}"
        self._consumers: list[_MemoryConsumer] = []

    async def start(self) -> None:
        self.hub.reply_sinks[self.reply_address] = self
        self.dead_letter_bounds_applied = self.hub.declare_dead(self.run, self.dead_letter_bounds)

    async def close(self) -> None:
        for consumer in list(self._consumers):
            await consumer.cancel()
        self._consumers.clear()
        self.hub.reply_sinks.pop(self.reply_address, None)
        self._pending.fail_all(ConnectionError("broker connection closed"))

    async def declare(self, address: str) -> None:
        for lane in Lane:
            self.hub.queues.setdefault((self.run, address, lane), _Queue())

    async def publish(self, address: str, envelope: Envelope, *, lane: Lane = Lane.DATA) -> None:
        await asyncio.sleep(0)  # a publish is a suspension point, as it is over the network
        self.hub.enqueue((self.run, address, lane), envelope)

    def is_reply_address(self, reply_to: str) -> bool:
        return reply_to.startswith(REPLY_PREFIX)

    async def reply(self, reply_to: str, envelope: Envelope) -> None:
        await asyncio.sleep(0)
        client = self.hub.reply_sinks.get(reply_to)
        if client is not None:  # like direct reply-to: a reply to a gone client is dropped
            client._pending.deliver(envelope)

    async def consume(
        self, address: str, handler: DeliveryHandler, *, prefetch: int = 16, lane: Lane = Lane.DATA
    ) -> Consumer:
        key = (self.run, address, lane)
        queue = self.hub.queues.get(key)
        if queue is None:
            raise Unroutable(unroutable_detail(key))
        consumer = _MemoryConsumer(self.hub, key, handler, prefetch)
        queue.consumers.append(consumer)
        self._consumers.append(consumer)
        self.hub.pump(queue)
        return consumer

    async def dead_letter(self, delivery: Delivery, *, code: str, detail: str) -> bool:
        headers = dead_letter_headers(delivery.envelope, origin=delivery.address, code=code, detail=detail)
        dead = self.hub.live_dead(self.run)
        bounds = self.hub.dead_bounds.get(self.run, self.dead_letter_bounds)
        kept = len(dead) < bounds.max_length
        if kept:
            dead.append((time.time(), replace(delivery.envelope, headers=headers)))
        else:
            self.dead_letters_dropped += 1
        await delivery.ack()
        return kept

    async def read_dead_letters(self, limit: int = 1000) -> list[DeadLetter]:
        dead = self.hub.live_dead(self.run)
        taken: list[DeadLetter] = []
        while dead and len(taken) < limit:
            taken.append(as_dead_letter(dead.popleft()[1]))
        return taken

    async def peek_dead_letters(self, limit: int = 100) -> tuple[list[DeadLetter], int]:
        dead = self.hub.live_dead(self.run)
        return [as_dead_letter(envelope) for _, envelope in list(dead)[:limit]], len(dead)

    async def purge_dead_letters(self, *, recreate: bool = False) -> int:
        dead = self.hub.live_dead(self.run)
        held = len(dead)
        dead.clear()
        if recreate:
            self.hub.dead_bounds[self.run] = self.dead_letter_bounds
            self.dead_letter_bounds_applied = True
        return held

    async def publish_log(self, line: bytes, *, checkpoint_id: str | None) -> None:
        self.hub.logs[self.run].append((time.time(), line))
        for follower in self.hub.log_followers[self.run]:
            follower.put_nowait(line)

    async def follow_logs(
        self, *, from_start: bool = True, since: float | None = None
    ) -> AsyncGenerator[bytes, None]:
        live: asyncio.Queue[bytes] = asyncio.Queue()
        backlog = [
            line
            for published, line in (self.hub.logs[self.run] if from_start else ())
            if since is None or published >= since
        ]
        self.hub.log_followers[self.run].add(live)
        try:
            for line in backlog:
                yield line
            while True:
                yield await live.get()
        finally:
            self.hub.log_followers[self.run].discard(live)
