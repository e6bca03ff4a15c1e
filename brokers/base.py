"""The broker interface every transport implements, and the pieces both implementations share.

Semantics (checked by ``tests/brokers/test_contract.py`` against both brokers):

- Addresses (``role/replica`` or any name) map to durable queues inside one run's namespace; two runs
  on one broker never see each other's messages.
- Each address has two lanes (``Lane``), each its own queue: ``DATA`` (the rollouts' messages) and
  ``CONTROL`` (the controller's commands), so that a command never waits behind the data queued before
  it. ``declare`` makes both; ``publish``, ``request`` and ``consume`` name one (``DATA`` unless told).
  Everything below holds for each lane on its own: its own FIFO order, prefetch, pause and redelivery;
  nothing orders one lane's messages against the other's.
- ``publish`` returns once the broker confirmed the message; an address nobody declared raises
  ``Unroutable`` instead of dropping the message silently.
- ``request`` publishes with a reply address and waits for the one reply carrying the request's id,
  until an absolute deadline (``RequestTimeout``). Late or duplicate replies are dropped and counted.
- ``consume`` delivers with manual acknowledgement, at most ``prefetch`` unacknowledged at a time. A
  delivery that is neither acked nor nacked when its consumer stops (cancel, connection loss, process
  death) is redelivered with ``redelivered=True``.
- A consumer can be paused and resumed: while paused, deliveries are held (unacked, in order) and the
  handler is not called; resume hands them over first. This is what an admission gate is made of.
- ``dead_letter`` moves a delivery to the run's dead-letter queue with the error that sent it there. The
  queue is bounded (``DeadLetterBounds``: a length and an age); one that is full refuses the new dead
  letter, which is dropped and counted (``dead_letters_dropped``), and the delivery is settled anyway.
- ``reply`` sends only to a reply address (``is_reply_address``: one the broker made for a requester),
  retrying a bounded number of times on a transport failure before it raises ``BrokerError``.
- Logs go to a per-run log stream; ``follow_logs`` reads it from the start or live.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import anyio

DEAD_LETTER_MAX_LENGTH_ENV = "PARKWAY_DEAD_LETTER_MAX_LENGTH"
DEAD_LETTER_MAX_AGE_ENV = "PARKWAY_DEAD_LETTER_MAX_AGE_S"
DEFAULT_DEAD_LETTER_MAX_LENGTH = 10_000
DEFAULT_DEAD_LETTER_MAX_AGE_S = 7 * 24 * 3600.0  # a week

REQUEST_ID_HEADER = "x-parkway-request-id"
ERROR_CODE_HEADER = "x-parkway-error-code"
ERROR_DETAIL_HEADER = "x-parkway-error-detail"
ORIGIN_HEADER = "x-parkway-origin"
CHECKPOINT_HEADER = "x-parkway-checkpoint-id"


class Lane(StrEnum):
    """Which of an address's two queues a message travels on."""

    DATA = "data"  # rollouts' messages: runs, model and tool calls, rows, receipts
    CONTROL = "control"  # control commands, so that a Prepare never waits behind model calls


class BrokerError(Exception):
    """A transport failure (connection lost, channel closed). Retryable by nature."""


class Unroutable(BrokerError):
    """Published to an address that has no queue in this run."""


class UnreachableReplyAddress(BrokerError):
    """The broker refused a reply address by closing the connection (a forged or foreign direct reply-to
    address): it is not tried again, and later replies to it are not sent."""


class RequestTimeout(BrokerError):
    """No reply arrived before the request's deadline."""


@dataclass(frozen=True, slots=True)
class Envelope:
    """A message as the transport sees it: opaque body plus routing facts."""

    body: bytes
    content_type: str
    correlation_id: str
    headers: Mapping[str, str] = field(default_factory=dict)
    reply_to: str | None = None
    persistent: bool = True


@dataclass(frozen=True, slots=True)
class DeadLetterBounds:
    """How much the run's dead-letter queue keeps: at most ``max_length`` messages (a full queue refuses
    new ones: they are dropped and counted), none older than ``max_age_s`` seconds (expired ones are
    dropped by the broker). A broker keeps the bounds its queue was first declared with."""

    max_length: int = DEFAULT_DEAD_LETTER_MAX_LENGTH
    max_age_s: float = DEFAULT_DEAD_LETTER_MAX_AGE_S

    def __post_init__(self) -> None:
        if self.max_length < 1:
            raise ValueError(f"dead-letter max length {self.max_length}: want at least 1")
        if not 1.0 <= self.max_age_s <= 365 * 24 * 3600.0:
            raise ValueError(f"dead-letter max age {self.max_age_s} s: want 1 s to a year")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DeadLetterBounds:
        """``PARKWAY_DEAD_LETTER_MAX_LENGTH`` and ``PARKWAY_DEAD_LETTER_MAX_AGE_S``, else the defaults."""
        env = os.environ if environ is None else environ
        length_text = env.get(DEAD_LETTER_MAX_LENGTH_ENV, "").strip()
        age_text = env.get(DEAD_LETTER_MAX_AGE_ENV, "").strip()
        try:
            length = int(length_text) if length_text else DEFAULT_DEAD_LETTER_MAX_LENGTH
        except ValueError:
            raise ValueError(f"{DEAD_LETTER_MAX_LENGTH_ENV}={length_text!r}: want a whole number") from None
        try:
            age = float(age_text) if age_text else DEFAULT_DEAD_LETTER_MAX_AGE_S
        except ValueError:
            raise ValueError(f"{DEAD_LETTER_MAX_AGE_ENV}={age_text!r}: want a number of seconds") from None
        return cls(max_length=length, max_age_s=age)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    envelope: Envelope
    origin: str
    code: str
    detail: str


class Delivery(ABC):
    """One received message. Exactly one of ack / nack / dead_letter settles it."""

    def __init__(
        self, envelope: Envelope, *, address: str, redelivered: bool, lane: Lane = Lane.DATA
    ) -> None:
        self.envelope = envelope
        self.address = address
        self.redelivered = redelivered
        self.lane = lane
        self.settled = False

    async def ack(self) -> None:
        if not self.settled:
            self.settled = True
            await self._ack()

    async def nack(self, *, requeue: bool = True) -> None:
        if not self.settled:
            self.settled = True
            await self._nack(requeue)

    @abstractmethod
    async def _ack(self) -> None: ...

    @abstractmethod
    async def _nack(self, requeue: bool) -> None: ...


DeliveryHandler = Callable[[Delivery], Coroutine[Any, Any, None]]


class Consumer:
    """A running consumption of one queue. Shared by both brokers so pause means the same thing."""

    def __init__(self, handler: DeliveryHandler) -> None:
        self._handler = handler
        self._paused = False
        self._held: collections.deque[Delivery] = collections.deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def held(self) -> int:
        """Deliveries received while paused, waiting for ``resume``."""
        return len(self._held)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def offer(self, delivery: Delivery) -> None:
        """Called by the transport for each delivery, in queue order."""
        if self._closed:
            return  # the transport requeues it when the consumer's channel closes
        if self._paused:
            self._held.append(delivery)
        else:
            self._start(delivery)

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        while self._held and not self._paused:
            self._start(self._held.popleft())

    async def drain(self) -> None:
        """Wait for the handlers already running (not the held deliveries)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _start(self, delivery: Delivery) -> None:
        task = asyncio.get_running_loop().create_task(self._handler(delivery))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel(self) -> None:
        """Stop consuming. Running handlers are cancelled; everything unsettled is redelivered."""
        self._closed = True
        self._held.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._close_transport()

    async def _close_transport(self) -> None:
        """Transport hook: stop the flow and make unsettled deliveries redeliverable."""


class LaneConsumers:
    """Every lane of one address consumed by one handler (what an actor runs): paused, drained and
    cancelled together, each lane's consumer with its own prefetch and its own queue order."""

    def __init__(self, consumers: Mapping[Lane, Consumer]) -> None:
        self.consumers = dict(consumers)

    @property
    def in_flight(self) -> int:
        return sum(consumer.in_flight for consumer in self.consumers.values())

    @property
    def held(self) -> int:
        return sum(consumer.held for consumer in self.consumers.values())

    def pause(self) -> None:
        for consumer in self.consumers.values():
            consumer.pause()

    def resume(self) -> None:
        for consumer in self.consumers.values():
            consumer.resume()

    async def drain(self) -> None:
        """Wait for the handlers already running on every lane (a paused group starts no more)."""
        await asyncio.gather(*(consumer.drain() for consumer in self.consumers.values()))

    async def cancel(self) -> None:
        for consumer in self.consumers.values():
            await consumer.cancel()


class Broker(ABC):
    """One process's connection to one run's namespace on a broker."""

    reply_address: str = ""  # where replies to this connection's requests go; set by each transport

    def __init__(self, run: str, *, dead_letter_bounds: DeadLetterBounds | None = None) -> None:
        self.run = run
        self.dead_letter_bounds = dead_letter_bounds or DeadLetterBounds.from_env()
        # False when the run's dead-letter queue already existed with other bounds (it keeps those).
        self.dead_letter_bounds_applied = True
        self.dead_letters_dropped = 0  # dead letters the full queue refused
        self.reply_retries = 0  # reply publishes that failed and were tried again
        self._pending = PendingReplies(self)
        self._request_ids = itertools.count()
        self._client_id = uuid.uuid4().hex[:12]
        self.duplicate_replies = 0  # replies to requests that were already answered
        self.late_replies = 0  # replies that came after their request's deadline
        # Correlation ids of the latest duplicates, for diagnosis (bounded: a long run has many).
        self.duplicate_reply_ids: collections.deque[str] = collections.deque(maxlen=1000)
        self.reconnects = 0

    async def __aenter__(self) -> Broker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def declare(self, address: str) -> None:
        """Make sure both lanes' queues for ``address`` exist (durable, dead-lettering to the run's DLQ)."""

    @abstractmethod
    async def publish(self, address: str, envelope: Envelope, *, lane: Lane = Lane.DATA) -> None: ...

    async def request(
        self, address: str, envelope: Envelope, *, deadline: float, lane: Lane = Lane.DATA
    ) -> Envelope:
        """Publish ``envelope`` on ``lane`` and return the reply to it, or raise ``RequestTimeout`` at
        ``deadline``."""
        sent = await self.send_request(address, envelope, deadline=deadline, lane=lane)
        return await sent.reply()

    async def send_request(
        self, address: str, envelope: Envelope, *, deadline: float, lane: Lane = Lane.DATA
    ) -> SentRequest:
        """Publish ``envelope`` on ``lane`` as a request and return once the broker has it: its reply is
        awaited apart (``SentRequest.reply``), so a caller can send several before it waits for any."""
        request_id = f"{self._client_id}#{next(self._request_ids)}"
        future = self._pending.open(request_id)
        headers = {**envelope.headers, REQUEST_ID_HEADER: request_id}
        try:
            await self.publish(
                address, replace(envelope, headers=headers, reply_to=self.reply_address), lane=lane
            )
        except BaseException:
            self._pending.close(request_id)
            raise
        return SentRequest(self._pending, request_id, future, deadline)

    @abstractmethod
    def is_reply_address(self, reply_to: str) -> bool:
        """Whether ``reply_to`` is an address this broker makes for requesters (never a command queue)."""

    @abstractmethod
    async def reply(self, reply_to: str, envelope: Envelope) -> None:
        """Send a reply; ``BrokerError`` once a bounded number of tries failed on the transport."""

    @abstractmethod
    async def consume(
        self, address: str, handler: DeliveryHandler, *, prefetch: int = 16, lane: Lane = Lane.DATA
    ) -> Consumer:
        """Consume the queue of ``address``'s ``lane``; ``Unroutable`` when it was never declared."""

    async def consume_lanes(
        self, address: str, handler: DeliveryHandler, *, prefetch: Mapping[Lane, int]
    ) -> LaneConsumers:
        """Consume every lane of ``address`` with ``handler``, each lane with its ``prefetch``."""
        consumers: dict[Lane, Consumer] = {}
        try:
            for lane in Lane:
                consumers[lane] = await self.consume(address, handler, prefetch=prefetch[lane], lane=lane)
        except BaseException:
            await LaneConsumers(consumers).cancel()  # all lanes or none: what one took is redelivered
            raise
        return LaneConsumers(consumers)

    @abstractmethod
    async def dead_letter(self, delivery: Delivery, *, code: str, detail: str) -> bool:
        """Move a delivery to the dead-letter queue (confirmed), then settle it. False when the queue was
        full and refused it: the dead letter is dropped (and counted), the delivery settled all the same."""

    @abstractmethod
    async def read_dead_letters(self, limit: int = 1000) -> list[DeadLetter]:
        """Take up to ``limit`` messages off the dead-letter queue (for tests and the CLI)."""

    @abstractmethod
    async def peek_dead_letters(self, limit: int = 100) -> tuple[list[DeadLetter], int]:
        """The oldest ``limit`` dead letters, left in the queue, and how many the queue holds."""

    @abstractmethod
    async def purge_dead_letters(self, *, recreate: bool = False) -> int:
        """Empty the dead-letter queue and return how many it held; ``recreate`` declares it anew with
        this broker's bounds (the way to change the bounds of a queue that already exists)."""

    @abstractmethod
    async def publish_log(self, line: bytes, *, checkpoint_id: str | None) -> None: ...

    @abstractmethod
    def follow_logs(
        self, *, from_start: bool = True, since: float | None = None
    ) -> AsyncGenerator[bytes, None]:
        """Log lines of this run, oldest first when ``from_start``, then live ones as they come.

        ``since`` (Unix time) skips most older lines: a stream seeks by chunk, so a few older ones may
        still come; readers that care compare the lines' own ``ts``."""


@dataclass(frozen=True)
class SentRequest:
    """A request the broker has: ``reply`` waits for its answer until its deadline (``RequestTimeout``)."""

    _pending: PendingReplies
    request_id: str
    _future: asyncio.Future[Envelope]
    deadline: float

    @property
    def answered(self) -> bool:
        """The reply is here already (the caller looks after it arrived)."""
        return self._future.done()

    async def reply(self) -> Envelope:
        return await self._pending.wait(self.request_id, self._future, deadline=self.deadline)


class PendingReplies:
    """Futures of requests in flight, keyed by request id. Shared by both brokers."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._futures: dict[str, asyncio.Future[Envelope]] = {}
        self._answered: collections.OrderedDict[str, None] = collections.OrderedDict()

    def open(self, request_id: str) -> asyncio.Future[Envelope]:
        future: asyncio.Future[Envelope] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        return future

    def close(self, request_id: str) -> None:
        self._futures.pop(request_id, None)

    def deliver(self, envelope: Envelope) -> None:
        request_id = envelope.headers.get(REQUEST_ID_HEADER, "")
        future = self._futures.pop(request_id, None)
        if future is None or future.done():
            # A second reply to an answered request is a duplicate; one to a request that gave up is late.
            if request_id in self._answered:
                self._broker.duplicate_replies += 1
                self._broker.duplicate_reply_ids.append(envelope.correlation_id)
            else:
                self._broker.late_replies += 1
            return
        future.set_result(envelope)
        self._answered[request_id] = None
        if len(self._answered) > 10_000:
            self._answered.popitem(last=False)

    def fail_all(self, exc: BaseException) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(exc)
        self._futures.clear()

    async def wait(self, request_id: str, future: asyncio.Future[Envelope], *, deadline: float) -> Envelope:
        try:
            with anyio.fail_after(max(0.0, deadline - time.time())):
                return await future
        except TimeoutError:
            raise RequestTimeout(f"no reply to request {request_id} before its deadline") from None
        finally:
            self.close(request_id)


def dead_letter_headers(envelope: Envelope, *, origin: str, code: str, detail: str) -> dict[str, str]:
    headers = dict(envelope.headers)
    headers[ORIGIN_HEADER] = origin
    headers[ERROR_CODE_HEADER] = code
    headers[ERROR_DETAIL_HEADER] = detail[:2000]
    return headers


def as_dead_letter(envelope: Envelope) -> DeadLetter:
    return DeadLetter(
        envelope=envelope,
        origin=envelope.headers.get(ORIGIN_HEADER, ""),
        code=envelope.headers.get(ERROR_CODE_HEADER, "expired_or_rejected"),
        detail=envelope.headers.get(ERROR_DETAIL_HEADER, ""),
    )
