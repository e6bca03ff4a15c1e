"""The actor runtime: one queue, typed handlers, cached replies, signatures, logs, graceful stop.

What happens to every delivery, in order:

1. the body's size is checked (``invalid_message`` over ``PARKWAY_MAX_BODY_BYTES``, 16 MiB by
   default), the signature, its destination (this actor's address) and the sender's right to send
   that type (``unauthorized``, see ``protocol.authorization``), the bytes decoded (``invalid_message``,
   ``unsupported_version``), a control command's correlation id checked against its checkpoint id;
   a refused message gets an ``Error`` reply where it has a reply address, goes to the dead-letter
   queue with the reason, and is logged. The actor carries on.
2. a reply cached for (correlation id, command, sender) is sent again without running the handler;
   a duplicate of a command still running waits for it and gets the same reply.
3. the handler runs with checkpoint id / rollout id / attempt bound in the log context; it returns the
   reply (or None). ``ProtocolError`` becomes a typed ``Error`` reply; any other exception an
   ``internal`` error reply plus a dead-letter copy of the message.
4. the reply is cached (journalled with a state dir), sent, and the delivery acked, in that order, so
   a crash at any point leaves the command to be redelivered and answered exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import structlog
from parkway.actors.runtime import heartbeat
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.faults import FaultPoints
from parkway.actors.runtime.history import History
from parkway.actors.runtime.metrics import ERROR, HANDLED, REFUSED, REPLAYED, UNKNOWN_TYPE, ActorMetrics
from parkway.actors.runtime.replies import ReplyCache
from parkway.actors.runtime.settings import SettingsError
from parkway.brokers.base import REQUEST_ID_HEADER, Broker, Consumer, Delivery, Envelope
from parkway.protocol import codec
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import Started
from parkway.protocol.ids import actor_address, validate_name
from parkway.protocol.messages import (
    Capabilities,
    ControlCommand,
    Discover,
    Error,
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
QUERIES = (Status, Discover)

Handler = Callable[[Any], Awaitable[Message | None]]


class Actor:
    """Base of every role. Subclasses set ``role`` and add handlers in ``__init__``."""

    role: ClassVar[str] = "actor"
    prefetch: int = 32  # deliveries in flight at once; a role sets its own, an instance may raise it

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
        self.state_dir = state_dir
        self.faults = faults or FaultPoints()
        self.history = History.from_env(broker.run, self.address)  # a no-op unless PARKWAY_HISTORY=1
        self.replies = ReplyCache(journal=state_dir / "replies.journal" if state_dir else None)
        self.started_at = time.time()
        self.handled = 0
        self.counts: Counter[str] = Counter()  # messages handled by type, errors by code
        self.metrics = ActorMetrics(self.role, replica)  # Prometheus, on this actor's own registry
        self.metrics.gauge(
            "parkway_handlers_in_flight", "Deliveries being handled now", lambda: self.in_flight
        )
        self.handlers: dict[type[Message], Handler] = {
            Status: self.on_status,
            Discover: self.on_discover,
            Probe: self.on_probe,
        }
        self._consumer: Consumer | None = None
        self._stopped = asyncio.Event()
        self._probe_log = state_dir / "probe.log" if state_dir else None
        self._heartbeat: asyncio.Task[None] | None = None

    @property
    def run(self) -> str:
        return self.broker.run

    def log_context(self) -> dict[str, object]:
        return {"actor": self.address, "role": self.role, "replica": self.replica, "run": self.run}

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.broker.declare(self.address)
        self._consumer = await self.broker.consume(self.address, self._on_delivery, prefetch=self.prefetch)
        self._heartbeat = asyncio.get_running_loop().create_task(heartbeat.beat(self))
        with structlog.contextvars.bound_contextvars(**self.log_context()):
            log.info("actor_started", pid=os.getpid())
        self.history.record(Started(started_at=self.started_at))

    async def stop(self) -> None:
        """Finish the handlers in progress; leave everything not yet started unacked for redelivery."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self._consumer is not None:
            self._consumer.pause()
            with structlog.contextvars.bound_contextvars(**self.log_context()):
                log.info("actor_stopping", in_flight=self._consumer.in_flight)
            await self._consumer.drain()
            await self._consumer.cancel()
            self._consumer = None
        with structlog.contextvars.bound_contextvars(**self.log_context()):
            log.info("actor_stopped", handled=self.handled)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    @property
    def in_flight(self) -> int:
        return self._consumer.in_flight if self._consumer else 0

    # -- the delivery pipeline -----------------------------------------------------------------
    async def _on_delivery(self, delivery: Delivery) -> None:
        with structlog.contextvars.bound_contextvars(**self.log_context()):
            await self._handle(delivery)

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
        if isinstance(message, QUERIES):  # read-only: always answered fresh, never cached
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
            await self._send_reply(envelope, cached)
            await delivery.ack()
            return

        self.replies.begin(key)
        reply: Message | None
        failure: Exception | None = None
        try:
            with structlog.contextvars.bound_contextvars(**_context_of(message)):
                try:
                    reply = await handler(message)
                except ProtocolError as err:
                    reply = Error(code=err.code, detail=err.detail, retryable=err.retryable)
                    log.info("command_refused", message_type=key[1], code=err.code.value, detail=err.detail)
                except Exception as exc:
                    failure = exc
                    reply = Error(code=ErrorCode.INTERNAL, detail=f"{type(exc).__name__}: {exc}")
                    log.exception("handler_failed", message_type=key[1])
        except BaseException:
            self.replies.finish(key, None, remember=False)  # cancelled (stop or crash): redelivered later
            raise
        content = codec.encode(reply) if reply is not None else None
        remember = reply is not None and not (isinstance(reply, Error) and reply.retryable)
        # Control replies are journaled (fsync) to survive a crash; data replies are cached in memory only,
        # their effects are made idempotent by their own keys (call index, tool-call key).
        self.replies.finish(key, content, remember=remember, durable=isinstance(message, ControlCommand))
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
            if content is not None:
                await self._send_reply(envelope, content)
        finally:
            await self.after_reply(message)
        self.faults.reach("after_reply_sent", key[1])
        if failure is not None:
            self.counts["refused:internal"] += 1
            await self.broker.dead_letter(delivery, code=ErrorCode.INTERNAL.value, detail=str(failure))
        else:
            await delivery.ack()

    async def _answer_query(self, delivery: Delivery, handler: Handler, message: Message) -> None:
        # At most once: ack first, so a crash never makes a restarted process answer it a second time.
        await delivery.ack()
        reply = await handler(message)
        self.counts[type(message).__name__] += 1
        self.metrics.message(type(message).__name__, HANDLED)
        if reply is not None:
            await self._send_reply(delivery.envelope, codec.encode(reply))

    def _open(self, envelope: Envelope) -> Message:
        message = self.client.open(envelope)
        if isinstance(message, ControlCommand) and envelope.correlation_id != message.checkpoint_id:
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"correlation id {envelope.correlation_id!r} differs from checkpoint id {message.checkpoint_id!r}",
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
            await self._send_reply(delivery.envelope, codec.encode(error))
        await self.broker.dead_letter(delivery, code=err.code.value, detail=err.detail)

    async def _send_reply(self, request: Envelope, content: bytes) -> None:
        if not request.reply_to:
            return
        content_type = codec.MSGPACK
        with contextlib.suppress(ProtocolError):
            content_type = codec.content_kind(request.content_type, request.body)
        reply = codec.decode(content, codec.MSGPACK)
        headers = {}
        if REQUEST_ID_HEADER in request.headers:
            headers[REQUEST_ID_HEADER] = request.headers[REQUEST_ID_HEADER]
        try:
            envelope = self.client.envelope(
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
            envelope = self.client.envelope(
                error,
                correlation_id=request.correlation_id,
                to=request.headers.get(SENDER_HEADER, ""),
                content_type=content_type,
                headers=headers,
                persistent=False,
            )
        await self.broker.reply(request.reply_to, envelope)

    async def after_reply(self, message: Message) -> None:
        """Runs once the reply to ``message`` is written (or failed to be): work that must not hold the
        reply back. Runs even when sending failed."""

    # -- handlers every actor has --------------------------------------------------------------
    def phase_name(self) -> str:
        return "serving"

    def status_extras(self) -> dict[str, Any]:
        return {}

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
        executions = 1
        if self._probe_log is not None:
            # The effect is the journal line; its reply is cached, so a redelivery does not repeat it.
            self._probe_log.parent.mkdir(parents=True, exist_ok=True)
            with open(self._probe_log, "a") as handle:
                handle.write(f"{probe.checkpoint_id} {os.getpid()}\n")
                handle.flush()
                os.fsync(handle.fileno())
            executions = sum(
                1
                for line in self._probe_log.read_text().splitlines()
                if line.split()[0] == probe.checkpoint_id
            )
        return ProbeResult(pid=os.getpid(), executions=executions, note=probe.note)


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
