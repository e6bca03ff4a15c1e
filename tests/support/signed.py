"""Signed raw envelopes for actor tests on the in-memory broker: what a buggy but authorised client sends."""

from __future__ import annotations

import json
import time

import msgspec
from parkway.actors.runtime.client import Client, signed_envelope
from parkway.brokers.base import Envelope
from parkway.protocol import codec
from parkway.protocol.errors import ProtocolError
from parkway.protocol.messages import Message
from parkway.protocol.signing import SENDER_HEADER, Keyring

SECRET = b"unit-test-secret"


def type_label(body: bytes, content_type: str) -> str:
    """The message type a sender would sign ``body`` as: the decoded message's, else the body's own
    ``type`` field, else ``Status`` (a type anyone may send, so the body itself is what gets judged)."""
    try:
        return type(codec.decode(body, content_type)).__name__
    except ProtocolError:
        pass
    try:
        document = json.loads(body) if content_type == codec.JSON else msgspec.msgpack.decode(body)
    except (ValueError, msgspec.DecodeError, RecursionError):
        return "Status"
    label = document.get("type") if isinstance(document, dict) else None
    return label if isinstance(label, str) else "Status"


def signed_raw(
    run: str,
    body: bytes,
    *,
    correlation_id: str,
    to: str,
    content_type: str = codec.JSON,
    sender: str = "test/0",
    secret: bytes = SECRET,
    message_type: str | None = None,
) -> Envelope:
    """An envelope around arbitrary bytes, correctly signed for ``to``: what a buggy but authorised
    client sends. Signed as ``message_type``, by default the type the body says it is."""
    return signed_envelope(
        Keyring.derive(secret, run),
        body,
        run=run,
        sender=sender,
        message_type=message_type or type_label(body, content_type),
        correlation_id=correlation_id,
        to=to,
        content_type=content_type,
    )


async def raw_request(client: Client, address: str, envelope: Envelope, timeout: float = 5.0) -> Message:
    """Send ``envelope`` to ``address`` and open the reply as its sender (the reply is signed for it)."""
    reply = await client.broker.request(address, envelope, deadline=time.time() + timeout)
    sender = envelope.headers.get(SENDER_HEADER, "")
    return Client(client.broker, secret=SECRET, sender=sender).open_reply(reply, requested=address)
