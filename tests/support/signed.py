"""Signed raw envelopes for actor tests on the in-memory broker: what a buggy but authorised client sends."""

from __future__ import annotations

import time

from parkway.actors.runtime.client import Client
from parkway.brokers.base import Envelope
from parkway.protocol import codec
from parkway.protocol.messages import Message
from parkway.protocol.signing import SENDER_HEADER, SIGNATURE_HEADER, sign

SECRET = b"unit-test-secret"


def signed_raw(
    run: str,
    body: bytes,
    *,
    correlation_id: str,
    content_type: str = codec.JSON,
    sender: str = "test/0",
    secret: bytes = SECRET,
) -> Envelope:
    """An envelope around arbitrary bytes, correctly signed: what a buggy but authorised client sends."""
    signature = sign(
        secret, run=run, sender=sender, correlation_id=correlation_id, content_type=content_type, body=body
    )
    return Envelope(body, content_type, correlation_id, {SENDER_HEADER: sender, SIGNATURE_HEADER: signature})


async def raw_request(client: Client, address: str, envelope: Envelope, timeout: float = 5.0) -> Message:
    reply = await client.broker.request(address, envelope, deadline=time.time() + timeout)
    return client.open(reply)
