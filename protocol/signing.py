"""HMAC signatures over a message and its routing facts, with a per-run secret.

The signed string binds the run, the sender, the correlation id, the content type and the exact body
bytes, so a message cannot be replayed into another run or re-attributed to another sender.
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "x-parkway-signature"
SENDER_HEADER = "x-parkway-sender"
RUN_HEADER = "x-parkway-run"


def signing_input(*, run: str, sender: str, correlation_id: str, content_type: str, body: bytes) -> bytes:
    head = "\n".join(("parkway-v1", run, sender, correlation_id, content_type)).encode()
    return head + b"\n" + body


def sign(secret: bytes, *, run: str, sender: str, correlation_id: str, content_type: str, body: bytes) -> str:
    data = signing_input(
        run=run, sender=sender, correlation_id=correlation_id, content_type=content_type, body=body
    )
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def verify(
    secret: bytes,
    signature: str | None,
    *,
    run: str,
    sender: str,
    correlation_id: str,
    content_type: str,
    body: bytes,
) -> bool:
    if not signature:
        return False
    expected = sign(
        secret, run=run, sender=sender, correlation_id=correlation_id, content_type=content_type, body=body
    )
    return hmac.compare_digest(expected, signature)
