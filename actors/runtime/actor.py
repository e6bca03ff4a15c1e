"""The actor runtime: two lanes, typed handlers, cached replies, signatures, logs, graceful stop.

An actor consumes both lanes of its address (``brokers.base.Lane``), the data lane with ``prefetch``
and the control lane with ``control_prefetch``, through the same pipeline: a message is handled the
same whichever lane it came on. What happens to every delivery, in order:

1. the body's size is checked (``invalid_message`` over ``PARKWAY_MAX_BODY_BYTES``, 16 MiB by
   default), the signature, its destination (this actor's address) and the sender's right to send
   that type (``unauthorized``, see ``protocol.authorization``), the bytes decoded (``invalid_message``,
   ``unsupported_version``), a control command's correlation id checked against its checkpoint id
   and its deadline against the horizon (``PARKWAY_MAX_DEADLINE_S``);
   a refused message gets an ``Error`` reply where it has a reply address, goes to the dead-letter
   queue with the reason, and is logged. The actor carries on.
2. a reply cached for (correlation id, command, sender) is sent again without running the handler;
   a duplicate of a command still running waits for it and gets the same reply.
3. the handler runs with checkpoint id / rollout id / attempt bound in the log context; it returns the
   reply (or None). ``ProtocolError`` becomes a typed ``Error`` reply; any other exception an
   ``internal`` error reply plus a dead-letter copy of the message.
4. the reply is cached (journalled with a state dir), sent, and the delivery acked, in that order, so
   a crash at any point leaves the command to be redelivered and answered exactly once. A reply the
   transport cannot send (the broker is restarting) is tried again a bounded number of times, then the
   delivery is nacked for redelivery; a redelivered request that was already answered is acked without
   a second reply. A ``reply_to`` that is not a reply address gets no reply (logged, counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import structlog
from parkway.actors.runtime import heartbeat, memory, tracing
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.faults import FaultPoints
from parkway.actors.runtime.history import History
from parkway.actors.runtime.metrics import (
    ERROR,
    HANDLED,
    REFUSED,
    REPLAYED,
    REPLY_NOT_A_REPLY_ADDRESS,
    REPLY_TRANSPORT,
    UNKNOWN_TYPE,
    ActorMetrics,
)
from parkway.actors.runtime.replies import ReplyCache
from parkway.actors.runtime.settings import MAX_DEADLINE_ENV, SettingsError, max_deadline_s
from parkway.actors.runtime.structures import StructureCollector, read_sizes, runtime_structure_sizes
from parkway.brokers.base import (
    REQUEST_ID_HEADER,
    Broker,
    BrokerError,
    Delivery,
    Envelope,
    Lane,
    LaneConsumers,
    UnreachableReplyAddress,
)
from parkway.protocol import codec
from parkway.protocol.epochs import check_epoch
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import Started
from parkway.protocol.ids import actor_address, validate_name
from parkway.protocol.messages import (
    DURABLE_REPLIES,
    Capabilities,
    ControlCommand,
    Discover,
    Error,
    MemoryReport,
    Message,
    Probe,
    ProbeResult,
    Status,
    StatusReport,
)
from parkway.protocol.signing import ROLES as ROLE_NAMES
from parkway.protocol.signing import SENDER_HEADER, Keyring

log = structlog.get_logger("parkway.actor")

# Read-only questions: no effect to deduplicate, and a cached answer would be stale.
QUERIES = (Status, Discover, MemoryReport)

Handler = Callable[[Any], Awaitable[Message | None]]


def request_key(request: Envelope) -> tuple[str, str] | None:
    """Who asked and under which request id: a reply goes once per key (None: not a request)."""
    request_id = request.headers.get(REQUEST_ID_HEADER)
    return (request.reply_to or "", request_id) if request_id else None


class Actor:
    """Base of every role. Subclasses set ``role`` and add handlers in ``__init__``."""

    role: ClassVar[str] = "actor"
    prefetch: int = 32  # data deliveries in flight at once; a role sets its own, an instance may raise it
    control_prefetch: int = 64  # control commands in flight at once, beside the data lane's
    queries: ClassVar[tuple[type[Message], ...]] = QUERIES  # a role adds its own read-only messages
    # Commands whose second run changes nothing (``Forget``, TQ's ``ReleaseRows``): a duplicate runs
    # again instead of being answered from the reply cache, so their replies are not kept. They came
    # one per batch of rollouts or per training step, owned by no rollout, and filled the cache and the
    # answered-request set to their capacity over a long run (issue 22's soak).
    idempotent: ClassVar[tuple[type[Message], ...]] = ()

    def __init__(
        self,
        broker: Broker,
        *,
        secret: bytes | None = None,
        keyring: Keyring | None = None,
        replica: int = 0,
        state_dir: Path | None = None,
        faults: FaultPoints | None = None,
        prefetch: int | None = None,
    ) -> None:
        validate_name(self.role, "role")
        if prefetch is not None:
            self.prefetch = max(prefetch, type(self).prefetch)
        self.broker = broker
        self.replica = replica
        self.address = actor_address(self.role, replica)
        self.client = Client(broker, secret=secret, keyring=keyring, sender=self.address)
        if self.role in ROLE_NAMES and self.role not in self.client.keyring.private:
            raise SettingsError(  # at construction, not at the first reply it could not sign
                f"{self.address}: this process holds no signing key for the {self.role} role "
                f"(PARKWAY_SIGNING_KEY names {', '.join(self.client.keyring.private) or 'none'})"
            )
        self.max_deadline_s = max_deadline_s()  # how far ahead a control command's deadline may be
        self.state_dir = state_dir
        self.faults = faults or FaultPoints()
        self.history = History.from_env(broker.run, self.address)  # a no-op unless PARKWAY_HISTORY=1
        self.replies = ReplyCache.from_env(journal=state_dir / "replies.journal" if state_dir else None)
        self.started_at = time.time()
        self.handled = 0
        self.counts: Counter[str] = Counter()  # messages handled by type, errors by code
        self.metrics = ActorMetrics(self.role, replica)  # Prometheus, on this actor's own registry
        self.metrics.gauge(
            "parkway_handlers_in_flight", "Deliveries being handled now", lambda: self.in_flight
        )
        self.metrics.registry.register(StructureCollector(self))  # parkway_structure_entries, at scrape
        self.handlers: dict[type[Message], Handler] = {
            Status: self.on_status,
            Discover: self.on_discover,
            Probe: self.on_probe,
            MemoryReport: functools.partial(memory.answer, self),  # runtime/memory.py
        }
        self._consumers: LaneConsumers | None = None
        self._stopped = asyncio.Event()
        self._probe_log = state_dir / "probe.log" if state_dir else None
        self._heartbeat: asyncio.Task[None] | None = None
        self._answered_requests: OrderedDict[tuple[str, str], None] = OrderedDict()
        # Requests whose first delivery is being handled: that delivery, and a future set when it is done.
        self._replying: dict[tuple[str, str], tuple[Delivery, asyncio.Future[None]]] = {}

    @property
    def run(self) -> str:
        return self.broker.run

    def log_context(self) -> dict[str, object]:
        return {"actor": self.address, "role": self.role, "replica": self.replica, "run": self.run}

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.broker.declare(self.address)
        prefetch = {Lane.DATA: self.prefetch, Lane.CONTROL: self.control_prefetch}
        self._consumers = await self.broker.consume_lanes(self.address, self._on_delivery, prefetch=prefetch)
        self._heartbeat = asyncio.get_running_loop().create_task(heartbeat.beat(self))
        memory.attach(self)  # SIGUSR2 logs its memory report; PARKWAY_TRACEMALLOC traces from boot
        with structlog.contextvars.bound_contextvars(**self.log_context()):
            log.info("actor_started", pid=os.getpid())
        self.history.record(Started(started_at=self.started_at))

    async def stop(self) -> None:
        """Finish the handlers in progress; leave everything not yet started unacked for redelivery."""
        memory.detach(self)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self._consumers is not None:
            self._consumers.pause()  # both lanes
            with structlog.contextvars.bound_contextvars(**self.log_context()):
                log.info("actor_stopping", in_flight=self._consumers.in_flight)
            await self._consumers.drain()
            await self._consumers.cancel()
            self._consumers = None
        with structlog.contextvars.bound_contextvars(**self.log_context()):
            log.info("actor_stopped", handled=self.handled)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    @property
    def in_flight(self) -> int:
        return self._consumers.in_flight if self._consumers else 0

    # -- the delivery pipeline -----------------------------------------------------------------
    async def _on_delivery(self, delivery: Delivery) -> None:
        # The first delivery of a request owns its reply; a redelivery of it while that one is still
        # in hand (its channel was closed under it: consumer_timeout, a broker restart) waits for it.
        key = request_key(delivery.envelope)
        owned = key if key is not None and key not in self._replying else None
        if owned is not None:
            self._replying[owned] = (delivery, asyncio.get_running_loop().create_future())
        try:
            with structlog.contextvars.bound_contextvars(**self.log_context()):
                await self._handle(delivery)
        finally:
            if owned is not None:
                _, done = self._replying.pop(owned)
                done.set_result(None)

    async def _handle(self, delivery: Delivery) -> None:
        envelope = delivery.envelope
        sender = envelope.headers.get(SENDER_HEADER, "")
        try:
            message = self._open(envelope)
        except ProtocolError as err:
            await self._refuse(delivery, err, sender, UNKNOWN_TYPE)
            return
        except Exception as exc:  # a decoder bug must not strand the delivery unsettled
            log.exception("decode_failed")
            await self._refuse(
                delivery,
                ProtocolError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"),
                sender,
                UNKNOWN_TYPE,
            )
            return
        handler = self.handlers.get(type(message))
        if handler is None:
            kind = type(message).__name__
            await self._refuse(
                delivery,
                ProtocolError(ErrorCode.INVALID_MESSAGE, f"{self.address} does not handle {kind}"),
                sender,
                kind,
            )
            return
        try:
            check_epoch(message, self.timeline())
        except ProtocolError as err:  # of a timeline a restore ended: dead-lettered like any refusal
            await self._refuse(delivery, err, sender, type(message).__name__)
            return
        if isinstance(message, self.queries):  # read-only: always answered fresh, never cached
            await self._answer_query(delivery, handler, message)
            return
        key = (envelope.correlation_id, type(message).__name__, sender)
        cached = self.replies.get(key)
        if cached is None and (running := self.replies.running(key)) is not None:
            cached = await running
        if cached is not None:
            self.counts["replayed"] += 1
            self.metrics.message(key[1], REPLAYED)
            log.info("reply_replayed", message_type=key[1], correlation_id=key[0], sender=sender)
            await self._answer_again(delivery, cached)
            return

        self.replies.begin(key)
        reply: Message | None
        failure: Exception | None = None
        try:
            with (
                structlog.contextvars.bound_contextvars(**_context_of(message)),
                tracing.handling(self.address, envelope.headers, message),
            ):
                try:
                    reply = await handler(message)
                except ProtocolError as err:
                    reply = Error(code=err.code, detail=err.detail, retryable=err.retryable)
                    tracing.mark_error(err.code.value, err.detail)
                    log.info("command_refused", message_type=key[1], code=err.code.value, detail=err.detail)
                except Exception as exc:
                    failure = exc
                    reply = Error(code=ErrorCode.INTERNAL, detail=f"{type(exc).__name__}: {exc}")
                    log.exception("handler_failed", message_type=key[1])
                    tracing.mark_error(ErrorCode.INTERNAL.value, str(exc))
        except BaseException:
            self.replies.finish(key, None, remember=False)  # cancelled (stop or crash): redelivered later
            raise
        content = codec.encode(reply) if reply is not None else None
        # Not remembered: a retryable error, and a handler that raised (its cause may be gone, a broker
        # restart): a retry or a resend runs the handler again.
        remember = (
            reply is not None
            and failure is None
            and not (isinstance(reply, Error) and reply.retryable)
            and not isinstance(message, self.idempotent)
        )
        # Replies of commands whose effect survives a crash are journaled (fsync); every other reply is
        # cached in memory only (``messages.DURABLE_REPLIES``): data messages' effects are idempotent by
        # their own keys (call index, tool-call key), and a control command's in-memory effect dies with
        # the process, so a new process must handle its redelivery afresh.
        self.replies.finish(key, content, remember=remember, durable=isinstance(message, DURABLE_REPLIES))
        self.handled += 1
        self.counts[key[1]] += 1
        if isinstance(reply, Error):
            self.counts[f"error:{reply.code.value}"] += 1
            self.metrics.message(key[1], ERROR)
            self.metrics.error(reply.code)
        else:
            self.metrics.message(key[1], HANDLED)
        self.faults.reach("after_reply_journaled", key[1])
        try:
            sent = content is None or await self._try_reply(envelope, content, cached=remember)
        finally:
            await self.after_reply(message)
        if not sent:  # the transport failed every try: redelivered later, answered from the cache
            await delivery.nack(requeue=True)
            return
        self.faults.reach("after_reply_sent", key[1])
        if failure is not None:
            self.counts["refused:internal"] += 1
            await self._dead_letter(delivery, code=ErrorCode.INTERNAL.value, detail=str(failure))
        else:
            await delivery.ack()

    async def _answer_again(self, delivery: Delivery, content: bytes) -> None:
        """Answer a duplicate from the cache. A redelivery of a request already answered (the consumer's
        channel closed before its ack: a broker restart, ``consumer_timeout``) is only acked, so each
        request gets one reply."""
        request = delivery.envelope
        key = request_key(request)
        owner = self._replying.get(key) if key is not None else None
        if owner is not None and owner[0] is not delivery:
            await asyncio.shield(owner[1])  # the first delivery of this request answers it, or fails to
        if key is not None and key in self._answered_requests:
            log.info("reply_already_sent", correlation_id=request.correlation_id)
            await delivery.ack()
        elif await self._try_reply(request, content):
            await delivery.ack()
        else:
            await delivery.nack(requeue=True)

    async def _try_reply(self, request: Envelope, content: bytes, *, cached: bool = True) -> bool:
        """Send the reply; False only when the transport failed every try (logged and counted).
        ``cached``: the reply is in the reply cache, so a redelivery of its request may be looked up
        (``_answer_again``); a query's is not, and remembering its request would be memory nobody reads."""
        try:
            await self._send_reply(request, content)
        except UnreachableReplyAddress as exc:  # settled as usual: a redelivery could only fail the same way
            self.counts["reply_refused"] += 1
            self.metrics.reply_not_sent(REPLY_NOT_A_REPLY_ADDRESS)
            log.warning("reply_address_unreachable", correlation_id=request.correlation_id, detail=str(exc))
            return True
        except BrokerError as exc:
            self.counts["reply_failed"] += 1
            self.metrics.reply_not_sent(REPLY_TRANSPORT)
            log.warning("reply_failed", correlation_id=request.correlation_id, detail=str(exc))
            return False
        key = request_key(request) if cached else None
        if key is not None:
            self._answered_requests[key] = None
            # Only a request whose reply is still cached is looked up here (``_answer_again``), so
            # remembering more than the cache holds is memory nobody reads: it once kept 10,000
            # pairs and grew TQ for thousands of rollouts after its reply cache was full. The cache
            # may hold fewer than its capacity (its byte bound), hence its length, not its capacity.
            while len(self._answered_requests) > max(len(self.replies), 1):
                self._answered_requests.popitem(last=False)
        return True

    async def _dead_letter(self, delivery: Delivery, *, code: str, detail: str) -> None:
        """Dead-letter and settle; a dead letter the full queue refused is counted and logged, and one the
        transport could not send leaves the delivery for redelivery."""
        try:
            kept = await self.broker.dead_letter(delivery, code=code, detail=detail)
        except BrokerError as exc:
            log.warning(
                "dead_letter_failed", correlation_id=delivery.envelope.correlation_id, detail=str(exc)
            )
            await delivery.nack(requeue=True)
            return
        if not kept:
            self.counts["dead_letter_dropped"] += 1
            log.warning("dead_letter_dropped", code=code, correlation_id=delivery.envelope.correlation_id)

    async def _answer_query(self, delivery: Delivery, handler: Handler, message: Message) -> None:
        # At most once: ack first, so a crash never makes a restarted process answer it a second time.
        await delivery.ack()
        try:
            reply = await handler(message)
        except ProtocolError as err:
            reply = Error(code=err.code, detail=err.detail, retryable=err.retryable)
        self.counts[type(message).__name__] += 1
        self.metrics.message(type(message).__name__, HANDLED)
        if reply is not None:
            await self._try_reply(delivery.envelope, codec.encode(reply), cached=False)

    def _open(self, envelope: Envelope) -> Message:
        message = self.client.open(envelope)
        if isinstance(message, ControlCommand) and envelope.correlation_id != message.checkpoint_id:
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"correlation id {envelope.correlation_id!r} differs from checkpoint id {message.checkpoint_id!r}",
            )
        # Decoding bounds a deadline to a finite Unix time; how far ahead of now it may be needs the
        # clock, so it is checked here: a deadline an hour out would hold a lease (and admission) that long.
        if isinstance(message, ControlCommand) and message.deadline > time.time() + self.max_deadline_s:
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"deadline {message.deadline} is {message.deadline - time.time():.0f}s ahead, beyond the "
                f"{self.max_deadline_s:g}s this actor accepts ({MAX_DEADLINE_ENV})",
            )
        return message

    async def _refuse(self, delivery: Delivery, err: ProtocolError, sender: str, kind: str) -> None:
        self.counts[f"refused:{err.code.value}"] += 1  # refused at the edge: each one is dead-lettered
        self.metrics.message(kind, REFUSED)
        self.metrics.error(err.code)
        log.warning(
            "message_refused",
            code=err.code.value,
            detail=err.detail,
            sender=sender,
            correlation_id=delivery.envelope.correlation_id,
            bytes=len(delivery.envelope.body),
        )
        error = Error(code=err.code, detail=err.detail, retryable=err.retryable)
        with contextlib.suppress(Exception):  # a reply we cannot send must not lose the dead letter
            await self._try_reply(delivery.envelope, codec.encode(error), cached=False)
        await self._dead_letter(delivery, code=err.code.value, detail=err.detail)

    async def _send_reply(self, request: Envelope, content: bytes) -> None:
        if not request.reply_to:
            return
        if not self.broker.is_reply_address(request.reply_to):
            # Another actor's queue (or any queue) named as reply_to: posting there would make that actor
            # refuse it and dead-letter it a second time. Nobody asked from there, so nobody is answered.
            self.counts["reply_refused"] += 1
            self.metrics.reply_not_sent(REPLY_NOT_A_REPLY_ADDRESS)
            log.warning(
                "reply_address_refused",
                reply_to=request.reply_to[:200],
                correlation_id=request.correlation_id,
                sender=request.headers.get(SENDER_HEADER, ""),
            )
            return
        await self.broker.reply(request.reply_to, reply_envelope(self.client, request, content))

    async def after_reply(self, message: Message) -> None:
        """Runs once the reply to ``message`` is written (or failed to be): work that must not hold the
        reply back. Runs even when sending failed."""

    def timeline(self) -> int:
        """The newest epoch this actor knows: a data message stamped with an older one is refused
        (``protocol/epochs.py``). 0 until a restore tells it one."""
        return 0

    # -- handlers every actor has --------------------------------------------------------------
    def phase_name(self) -> str:
        return "serving"

    def status_extras(self) -> dict[str, Any]:
        return {}

    def structure_sizes(self) -> dict[str, int]:
        """Entries per named per-rollout / per-snapshot structure (``runtime/structures.py``); a role
        returns ``{**super().structure_sizes(), "sessions": len(self.sessions)}``."""
        return runtime_structure_sizes(self)

    def status_fields(self, *, asking: int = 0) -> dict[str, Any]:
        """What ``Status`` and the heartbeat report; ``asking`` messages in flight are the question."""
        fields: dict[str, Any] = {
            "role": self.role,
            "replica": self.replica,
            "run": self.run,
            "pid": os.getpid(),
            "phase": self.phase_name(),
            "in_flight": max(0, self.in_flight - asking),
            "started_at": self.started_at,
            "handled": self.handled,
            "counts": dict(self.counts),
            "structures": read_sizes(self),
        }
        fields.update(self.status_extras())  # a role may say better what "in flight" means for it
        return fields

    async def on_status(self, _: Status) -> Message:
        return StatusReport(**self.status_fields(asking=1))

    async def on_discover(self, _: Discover) -> Message:
        return Capabilities(role=self.role, replica=self.replica)

    async def on_probe(self, probe: Probe) -> Message:
        if probe.work_s:
            await asyncio.sleep(probe.work_s)
        executions = 1 if self._probe_log is None else journal_probe(self._probe_log, probe.checkpoint_id)
        return ProbeResult(pid=os.getpid(), executions=executions, note=probe.note)


def journal_probe(path: Path, checkpoint_id: str) -> int:
    """Append this execution of probe ``checkpoint_id`` to the journal at ``path`` (fsynced); how many
    times it was executed, this one included. The effect is the journal line; the probe's reply is
    cached, so a redelivery does not repeat it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(f"{checkpoint_id} {os.getpid()}\n")
        handle.flush()
        os.fsync(handle.fileno())
    return sum(1 for line in path.read_text().splitlines() if line.split()[0] == checkpoint_id)


def reply_envelope(client: Client, request: Envelope, content: bytes) -> Envelope:
    """The encoded reply ``content`` to ``request``, signed for its sender, in the request's content type."""
    content_type = codec.MSGPACK
    with contextlib.suppress(ProtocolError):
        content_type = codec.content_kind(request.content_type, request.body)
    reply = codec.decode(content, codec.MSGPACK)
    headers = {}
    if REQUEST_ID_HEADER in request.headers:
        headers[REQUEST_ID_HEADER] = request.headers[REQUEST_ID_HEADER]
    try:
        envelope = client.envelope(
            reply,
            correlation_id=request.correlation_id,
            to=request.headers.get(SENDER_HEADER, ""),
            content_type=content_type,
            headers=headers,
            persistent=False,
        )
    except ProtocolError as err:  # a reply over the size limit: the requester gets why instead
        log.warning("reply_too_large", message_type=type(reply).__name__, detail=err.detail)
        error = Error(code=err.code, detail=f"the reply was not sent: {err.detail}; ask for less")
        envelope = client.envelope(
            error,
            correlation_id=request.correlation_id,
            to=request.headers.get(SENDER_HEADER, ""),
            content_type=content_type,
            headers=headers,
            persistent=False,
        )
    return envelope


def _context_of(message: Message) -> dict[str, object]:
    """What to bind in the log context for this message."""
    context: dict[str, object] = {}
    if isinstance(message, ControlCommand):
        context["checkpoint_id"] = message.checkpoint_id
    rollout_id = getattr(message, "rollout_id", None)
    if rollout_id is not None:
        context["rollout_id"] = rollout_id
        context["attempt"] = getattr(message, "attempt", None)
    return context
