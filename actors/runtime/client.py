"""Signing and sending messages: what every actor, the controller and the CLI use to talk.

A ``Client`` turns typed messages into signed envelopes and signed reply envelopes back into typed
messages; a reply whose signature does not verify is refused, like any other message.
"""

from __future__ import annotations

import time

from parkway.actors.runtime.settings import max_body_bytes
from parkway.brokers.base import Broker, Envelope
from parkway.protocol import codec
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import ControlCommand, Error, Message
from parkway.protocol.signing import SENDER_HEADER, SIGNATURE_HEADER, sign, verify


class Client:
    def __init__(self, broker: Broker, *, secret: bytes, sender: str, max_bytes: int | None = None) -> None:
        self.broker = broker
        self.secret = secret
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
        content_type: str = codec.MSGPACK,
        headers: dict[str, str] | None = None,
        persistent: bool = True,
    ) -> Envelope:
        body = codec.encode(message, content_type)
        if len(body) > self.max_bytes:  # the receiver would refuse it: say so here, send nothing
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"{type(message).__name__} of {len(body)} bytes exceeds the limit of {self.max_bytes} bytes",
            )
        signature = sign(
            self.secret,
            run=self.run,
            sender=self.sender,
            correlation_id=correlation_id,
            content_type=content_type,
            body=body,
        )
        all_headers = {**(headers or {}), SENDER_HEADER: self.sender, SIGNATURE_HEADER: signature}
        return Envelope(body, content_type, correlation_id, all_headers, persistent=persistent)

    def open(self, envelope: Envelope) -> Message:
        """Verify and decode a received envelope, or raise ``ProtocolError``. An oversized body is
        refused before anything reads it (even before its signature is checked)."""
        codec.check_size(envelope.body, self.max_bytes)
        sender = envelope.headers.get(SENDER_HEADER, "")
        if not verify(
            self.secret,
            envelope.headers.get(SIGNATURE_HEADER),
            run=self.run,
            sender=sender,
            correlation_id=envelope.correlation_id,
            content_type=envelope.content_type,
            body=envelope.body,
        ):
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                f"signature of a message from {sender or 'an unnamed sender'} does not verify for run "
                f"{self.run!r} (wrong secret, unsigned, or a message from another run)",
            )
        return codec.decode(envelope.body, envelope.content_type, max_bytes=self.max_bytes)

    async def send(
        self, address: str, message: Message, *, correlation_id: str, persistent: bool = True
    ) -> None:
        await self.broker.publish(
            address, self.envelope(message, correlation_id=correlation_id, persistent=persistent)
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
    ) -> Message:
        """Send and wait for the typed reply. ``Error`` replies are returned, not raised."""
        if isinstance(message, ControlCommand):
            correlation_id = message.checkpoint_id
            deadline = message.deadline if deadline is None else deadline
        if correlation_id is None:
            raise ValueError("a data request needs a correlation id")
        reply = await self.broker.request(
            address,
            self.envelope(message, correlation_id=correlation_id, content_type=content_type),
            deadline=deadline if deadline is not None else time.time() + timeout,
        )
        return self.open(reply)

    async def call(
        self,
        address: str,
        message: Message,
        *,
        correlation_id: str | None = None,
        deadline: float | None = None,
        timeout: float = 10.0,
        content_type: str = codec.MSGPACK,
    ) -> Message:
        """Like ``request`` but raises ``ProtocolError`` for an ``Error`` reply."""
        reply = await self.request(
            address,
            message,
            correlation_id=correlation_id,
            deadline=deadline,
            timeout=timeout,
            content_type=content_type,
        )
        if isinstance(reply, Error):
            raise ProtocolError(reply.code, reply.detail)
        return reply
