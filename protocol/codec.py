"""Bytes <-> typed messages. MessagePack by default; JSON accepted by content type.

Decoding is done in two steps so each failure gets the right code: a lenient look at ``type`` and
``v`` first (unknown version -> ``unsupported_version``, unknown type -> ``invalid_message``), then a
strict decode of the whole message against its Struct, numeric ranges included (``ranges``). Whatever
the bytes, ``decode`` returns a message or raises ``ProtocolError``; nothing else escapes it.
"""

from __future__ import annotations

from typing import Final

import msgspec
from parkway.protocol import SCHEMA_VERSION
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import MESSAGE_TYPES, AnyMessage, Message

MSGPACK: Final = "application/msgpack"
JSON: Final = "application/json"
_MSGPACK_ALIASES = frozenset({MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})
_JSON_ALIASES = frozenset({JSON, "text/json"})

# Bodies above this are refused before any parsing (control and data messages are small). The same
# default as RabbitMQ 4's ``max_message_size`` (RabbitMQ 3 allows 128 MiB); actors and clients take
# another limit from ``PARKWAY_MAX_BODY_BYTES`` (``actors/runtime/settings.py``).
MAX_BODY_BYTES: Final = 16 * 1024 * 1024


def check_size(body: bytes, max_bytes: int = MAX_BODY_BYTES) -> None:
    """Refuse a body over ``max_bytes`` with ``invalid_message``, naming both sizes."""
    if len(body) > max_bytes:
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE, f"body of {len(body)} bytes exceeds the limit of {max_bytes} bytes"
        )


# msgspec recurses (in C, under the interpreter's recursion limit) into every nested array or map,
# also one it only skips: a body nested about a thousand deep raises RecursionError, in either step
# (found by fuzzing). No parkway message comes near that depth, so it is refused like any bad body.
_TOO_DEEP = "nested too deeply to decode (RecursionError)"


# A refusal's detail quotes the bad value (a field check's message does): a megabyte string would be
# echoed into the Error reply, the log line and the dead letter (found by fuzzing). Cut it here.
MAX_DETAIL_CHARS: Final = 500


def _brief(exc: Exception) -> str:
    return _brief_text(str(exc))


def _brief_text(text: str) -> str:
    if len(text) <= MAX_DETAIL_CHARS:
        return text
    return f"{text[:MAX_DETAIL_CHARS]}... ({len(text)} characters)"


class _Header(msgspec.Struct):
    type: str
    v: int


_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder(AnyMessage)
_json_decoder = msgspec.json.Decoder(AnyMessage)
_msgpack_header = msgspec.msgpack.Decoder(_Header)
_json_header = msgspec.json.Decoder(_Header)


def content_kind(content_type: str | None, body: bytes) -> str:
    """Normalise a content type; sniff when a foreign client sent none ('{' is never a msgpack map)."""
    if content_type:
        base = content_type.split(";", 1)[0].strip().lower()
        if base in _MSGPACK_ALIASES:
            return MSGPACK
        if base in _JSON_ALIASES:
            return JSON
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"unsupported content type {content_type!r}")
    return JSON if body[:1] in (b"{", b" ", b"\n", b"\t", b"\r") else MSGPACK


def encode(message: Message, content_type: str = MSGPACK) -> bytes:
    if content_type == JSON:
        return _json_encoder.encode(message)
    return _msgpack_encoder.encode(message)


def decode(body: bytes, content_type: str | None = None, *, max_bytes: int = MAX_BODY_BYTES) -> Message:
    """Decode one message or raise ``ProtocolError`` with ``invalid_message``/``unsupported_version``."""
    check_size(body, max_bytes)
    kind = content_kind(content_type, body)
    header_decoder, full_decoder = (
        (_json_header, _json_decoder) if kind == JSON else (_msgpack_header, _msgpack_decoder)
    )
    try:
        header = header_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"not a parkway message: {_brief(exc)}") from None
    except RecursionError:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"not a parkway message: {_TOO_DEEP}") from None
    if header.v != SCHEMA_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"schema version {header.v} is not supported (this actor speaks {SCHEMA_VERSION})",
        )
    if header.type not in MESSAGE_TYPES:
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE, f"unknown message type {_brief_text(repr(header.type))}"
        )
    try:
        return full_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        # msgspec lets a bad UTF-8 string in MessagePack through as UnicodeDecodeError (found by fuzzing).
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"invalid {header.type}: {_brief(exc)}") from None
    except RecursionError:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"invalid {header.type}: {_TOO_DEEP}") from None


def to_builtins(message: Message) -> dict[str, object]:
    """A JSON-ready dict of a message, with its ``type`` tag (for printing and logs)."""
    builtins = msgspec.to_builtins(message)
    assert isinstance(builtins, dict)  # a Struct becomes a dict
    return builtins


def from_builtins(data: dict[str, object]) -> Message:
    """Build a message from a dict (CLI ``--set``); same checks as ``decode``."""
    return decode(_json_encoder.encode(data), JSON)
