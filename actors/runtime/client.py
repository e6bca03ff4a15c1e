"""Signing and sending messages: what every actor, the controller and the CLI use to talk.

A ``Client`` turns typed messages into envelopes signed for their destination and signed envelopes
back into typed messages: a request is accepted only if it was signed for this address by a role
allowed to send it, a reply only if it was signed for this client by the address the request went to.

Each message goes on a lane of its destination (``brokers.base.Lane``), by default the one of its type
(``lane_of``): every control command on the control lane, so that it never waits behind the data
queued for that actor, and everything else on the data lane. A sender may name the lane instead: a
control command sent on the data lane is handled after every data message queued there before it
(TQ's capture at a snapshot is sent so, to hold every row already on its way to TQ). The receiver
handles a message the same on either lane.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import structlog
from parkway.actors.runtime import tracing
from parkway.actors.runtime.backoff import retrying
from parkway.actors.runtime.settings import max_body_bytes
from parkway.brokers.base import Broker, BrokerError, Envelope, Lane, SentRequest
from parkway.protocol import codec
from parkway.protocol.authorization import address_role, request_refusal, sender_refusal, signing_role
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import DURABLE_REPLIES, ControlCommand, Error, Message
from parkway.protocol.signing import (
    KEY_HEADER,
    MESSAGE_ID_HEADER,
    SENDER_HEADER,
    SIGNATURE_HEADER,
    TO_HEADER,
    TYPE_HEADER,
    Keyring,
    signing_input,
)

log = structlog.get_logger("parkway.client")
SEND_RETRY_FIRST_S, SEND_RETRY_MAX_S = 0.25, 4.0  # the pause before a publish is tried again
MAX_CORRELATION_ID_BYTES = 255  # an AMQP short string


@dataclass(frozen=True)
class SentCall:
    """A request the broker has; ``reply`` is its typed answer (checked as ``Client.request`` checks it)."""

    client: Client
    address: str
    sent: SentRequest
    command: bool = False  # a control command: its reply is traced at the requester

    async def reply(self) -> Message:
        if not self.command:  # a data request's round trip is already its rollout's span
            return self.client.open_reply(await self.sent.reply(), requested=self.address)
        # A reply that arrived before it was asked for (sent in a step, collected in a later one) has
        # no way back to draw: the time it waited is the requester's, not the reply's.
        waited = not self.sent.answered
        envelope = await self.sent.reply()
        began = time.perf_counter()
        reply = self.client.open_reply(envelope, requested=self.address)
        if waited:  # a command's way back is on a snapshot's critical path
            tracing.reply_opened(
                self.client.sender, self.address, envelope.headers, reply, time.perf_counter() - began
            )
        return reply


def lane_of(message: Message, lane: Lane | None = None) -> Lane:
    """The lane ``message`` travels on: ``lane`` when given, else its type's (control commands on the
    control lane, every other message on the data lane)."""
    if lane is not None:
        return lane
    return Lane.CONTROL if isinstance(message, ControlCommand) else Lane.DATA


def signed_envelope(
    keyring: Keyring,
    body: bytes,
    *,
    run: str,
    sender: str,
    message_type: str,
    correlation_id: str,
    to: str,
    content_type: str,
    headers: dict[str, str] | None = None,
    persistent: bool = True,
) -> Envelope:
    """``body`` from ``sender`` for ``to``, signed with the key ``protocol.authorization`` picks for it."""
    key_role = signing_role(sender, message_type, set(keyring.private))
    if key_role is None:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, f"this process holds no signing key for sender {sender}")
    message_id = secrets.token_hex(8)
    data = signing_input(
        run=run,
        sender=sender,
        key_role=key_role,
        to=to,
        message_type=message_type,
        correlation_id=correlation_id,
        message_id=message_id,
        content_type=content_type,
        body=body,
    )
    all_headers = {
        **(headers or {}),
        SENDER_HEADER: sender,
        KEY_HEADER: key_role,
        TO_HEADER: to,
        TYPE_HEADER: message_type,
        MESSAGE_ID_HEADER: message_id,
        SIGNATURE_HEADER: keyring.sign(key_role, data),
    }
    tracing.inject(all_headers)  # trace context rides unsigned beside the signed fields (docs/tracing.md)
    return Envelope(body, content_type, correlation_id, all_headers, persistent=persistent)


class Client:
    """Signs as ``sender`` with the keyring's key for that sender (``protocol.authorization``). Give a
    ``keyring`` (a process's own keys and the run's public table) or a ``secret``, from which every
    role's keys are derived: for one address space only, where every actor could read every key anyway."""

    def __init__(
        self,
        broker: Broker,
        *,
        sender: str,
        secret: bytes | None = None,
        keyring: Keyring | None = None,
        max_bytes: int | None = None,
    ) -> None:
        if keyring is None:
            if secret is None:
                raise TypeError("a Client needs a keyring or a secret")
            keyring = Keyring.derive(secret, broker.run)
        self.broker = broker
        self.keyring = keyring
        self.sender = sender
        self.max_bytes = max_bytes if max_bytes is not None else max_body_bytes()

    @property
    def run(self) -> str:
        return self.broker.run

    def envelope(
        self,
        message: Message,
        *,
        correlation_id: str,
        to: str,
        content_type: str = codec.MSGPACK,
        headers: dict[str, str] | None = None,
        persistent: bool = True,
    ) -> Envelope:
        """``message`` for the actor (or requester) at ``to``, signed for that destination only."""
        body = codec.encode(message, content_type)
        if len(body) > self.max_bytes:  # the receiver would refuse it: say so here, send nothing
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"{type(message).__name__} of {len(body)} bytes exceeds the limit of {self.max_bytes} bytes",
            )
        return self.signed(
            body,
            message_type=type(message).__name__,
            correlation_id=correlation_id,
            to=to,
            content_type=content_type,
            headers=headers,
            persistent=persistent,
        )

    def signed(
        self,
        body: bytes,
        *,
        message_type: str,
        correlation_id: str,
        to: str,
        content_type: str,
        headers: dict[str, str] | None = None,
        persistent: bool = True,
    ) -> Envelope:
        """An envelope around ``body`` as it is, signed: ``envelope`` for bytes already encoded."""
        if len(correlation_id.encode("utf-8", "surrogatepass")) > MAX_CORRELATION_ID_BYTES:
            # The broker carries at most this many: refused here, typed, not failed in the transport.
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"correlation id of {message_type} is longer than {MAX_CORRELATION_ID_BYTES} bytes",
            )
        return signed_envelope(
            self.keyring,
            body,
            run=self.run,
            sender=self.sender,
            message_type=message_type,
            correlation_id=correlation_id,
            to=to,
            content_type=content_type,
            headers=headers,
            persistent=persistent,
        )

    def open(self, envelope: Envelope, *, at: str | None = None) -> Message:
        """Verify, authorize and decode a request delivered to this client's address (or ``at``), or
        raise ``ProtocolError``. It must be signed for this address by a key of the role its sender
        address names, and that role must be allowed to send its type (``protocol.authorization``). An
        oversized body is refused before anything reads it (even before its signature is checked)."""
        sender, key_role, message_type = self._verified(envelope, at or self.sender)
        message = self._decoded(envelope, message_type)  # a malformed body is invalid_message
        refusal = request_refusal(key_role, message_type)
        if refusal is not None:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, f"from {sender}: {refusal}")
        return message

    def open_reply(self, envelope: Envelope, *, requested: str) -> Message:
        """Verify and decode the reply to a request sent to ``requested``: signed for this client by
        that very address, with its role's key."""
        sender, key_role, message_type = self._verified(envelope, self.sender)
        named = address_role(requested)
        if sender != requested or (named is not None and key_role != named):
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                f"a reply to a request sent to {requested} comes from {sender or 'nobody'} "
                f"signed by the {key_role} key",
            )
        return self._decoded(envelope, message_type)

    def _verified(self, envelope: Envelope, address: str) -> tuple[str, str, str]:
        codec.check_size(envelope.body, self.max_bytes)
        headers = envelope.headers
        sender = headers.get(SENDER_HEADER, "")
        key_role = headers.get(KEY_HEADER, "")
        to = headers.get(TO_HEADER, "")
        message_type = headers.get(TYPE_HEADER, "")
        data = signing_input(
            run=self.run,
            sender=sender,
            key_role=key_role,
            to=to,
            message_type=message_type,
            correlation_id=envelope.correlation_id,
            message_id=headers.get(MESSAGE_ID_HEADER, ""),
            content_type=envelope.content_type,
            body=envelope.body,
        )
        if not self.keyring.verify(key_role, data, headers.get(SIGNATURE_HEADER)):
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                f"signature of a message from {sender or 'an unnamed sender'} does not verify for run "
                f"{self.run!r} (a key not of this run's table, unsigned, or a message from another run)",
            )
        if to != address:  # signed for another queue and moved here: one capture must not fan out
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED, f"a message from {sender} signed for {to} was delivered to {address}"
            )
        refusal = sender_refusal(sender, key_role)
        if refusal is not None:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, refusal)
        return sender, key_role, message_type

    def _decoded(self, envelope: Envelope, message_type: str) -> Message:
        message = codec.decode(envelope.body, envelope.content_type, max_bytes=self.max_bytes)
        if type(message).__name__ != message_type:
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                f"the body is a {type(message).__name__} but was signed as a {message_type}",
            )
        return message

    async def send(
        self,
        address: str,
        message: Message,
        *,
        correlation_id: str,
        persistent: bool = True,
        retry_for_s: float = 0.0,
        lane: Lane | None = None,
    ) -> None:
        """Publish ``message`` to ``address``, on ``lane`` (None: its type's, ``lane_of``). With
        ``retry_for_s``, a publish the broker cannot take (a broker restarting, a channel reopening) is
        tried again, backing off, for that long before its ``BrokerError`` is raised: for one-way
        messages whose receiver deduplicates them by id."""
        envelope = self.envelope(message, correlation_id=correlation_id, to=address, persistent=persistent)
        on = lane_of(message, lane)
        await retrying(
            lambda: self.broker.publish(address, envelope, lane=on),
            retry_on=BrokerError,
            for_s=retry_for_s,
            first_s=SEND_RETRY_FIRST_S,
            max_s=SEND_RETRY_MAX_S,
            on_retry=lambda exc, _: log.warning(
                "send_retried", to=address, message_type=type(message).__name__, error=str(exc)
            ),
        )

    async def request(
        self,
        address: str,
        message: Message,
        *,
        correlation_id: str | None = None,
        deadline: float | None = None,
        timeout: float = 10.0,
        content_type: str = codec.MSGPACK,
        lane: Lane | None = None,
    ) -> Message:
        """Send on ``lane`` (None: the message type's, ``lane_of``) and wait for the typed reply.
        ``Error`` replies are returned, not raised."""
        sent = await self.send_request(
            address,
            message,
            correlation_id=correlation_id,
            deadline=deadline,
            timeout=timeout,
            content_type=content_type,
            lane=lane,
        )
        return await sent.reply()

    async def send_request(
        self,
        address: str,
        message: Message,
        *,
        correlation_id: str | None = None,
        deadline: float | None = None,
        timeout: float = 10.0,
        content_type: str = codec.MSGPACK,
        lane: Lane | None = None,
    ) -> SentCall:
        """Send as ``request`` does, returning once the broker has it; ``SentCall.reply`` waits for
        the typed reply. Several can go out before any reply is awaited."""
        if isinstance(message, ControlCommand):
            correlation_id = message.checkpoint_id
            deadline = message.deadline if deadline is None else deadline
        if correlation_id is None:
            raise ValueError("a data request needs a correlation id")
        # A control command whose effect dies with its process is not persisted by the broker: a
        # persistent message is confirmed only once the broker wrote it to disk (milliseconds, inside a
        # snapshot's window), and one that a broker restart kept would only be a stale command later
        # (its sender has given up and will resend). One whose effect outlives the process (files
        # written, a journal line) is kept like data: redelivered, its journaled reply answers it.
        persistent = not isinstance(message, ControlCommand) or isinstance(message, DURABLE_REPLIES)
        sent = await self.broker.send_request(
            address,
            self.envelope(
                message,
                correlation_id=correlation_id,
                to=address,
                content_type=content_type,
                persistent=persistent,
            ),
            deadline=deadline if deadline is not None else time.time() + timeout,
            lane=lane_of(message, lane),
        )
        return SentCall(self, address, sent, command=isinstance(message, ControlCommand))

    async def call(
        self,
        address: str,
        message: Message,
        *,
        correlation_id: str | None = None,
        deadline: float | None = None,
        timeout: float = 10.0,
        content_type: str = codec.MSGPACK,
        lane: Lane | None = None,
    ) -> Message:
        """Like ``request`` but raises ``ProtocolError`` for an ``Error`` reply."""
        reply = await self.request(
            address,
            message,
            correlation_id=correlation_id,
            deadline=deadline,
            timeout=timeout,
            content_type=content_type,
            lane=lane,
        )
        if isinstance(reply, Error):
            raise ProtocolError(reply.code, reply.detail)
        return reply
