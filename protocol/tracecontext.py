"""W3C trace context as parkway carries it, and the trace ids parkway derives (pure: no I/O, no clock).

A message's ``traceparent`` header is read here and nowhere else: anything that is not exactly a
version-00 value (``00-<32 hex>-<16 hex>-<2 hex>``) with non-zero ids is no parent at all, so a
malformed, oversized or hostile value starts a new root span and changes nothing else about the
delivery (docs/tracing.md#bad-trace-headers).

A snapshot's trace id is derived from its checkpoint id, and a rollout attempt's from its rollout id
and attempt, so the id a user already knows finds the trace, and a later attempt can link to an
earlier one that died with its process (docs/tracing.md#trace-ids).
"""

from __future__ import annotations

import hashlib
import math
import re
from functools import lru_cache
from typing import NamedTuple

TRACEPARENT_HEADER = "traceparent"
# Wall-clock time of the publish (Unix seconds, as text): the receiver's queued time starts here.
PUBLISHED_AT_HEADER = "x-parkway-published-at"
SPAN_EVENT = "span"  # the ``event`` of a finished span's line on the log stream (the parkway exporter)
MAX_HEADER_CHARS = 64  # a version-00 traceparent is 55 characters; anything longer is refused unread
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


class ParentContext(NamedTuple):
    """What a valid ``traceparent`` names: the remote parent span."""

    trace_id: int
    span_id: int
    sampled: bool


def parse_traceparent(value: object) -> ParentContext | None:
    """The parent a ``traceparent`` header names, or None for anything else (never raises)."""
    if not isinstance(value, str) or len(value) > MAX_HEADER_CHARS:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    trace_id, span_id = int(match.group(1), 16), int(match.group(2), 16)
    if trace_id == 0 or span_id == 0:  # the spec's invalid ids
        return None
    return ParentContext(trace_id, span_id, bool(int(match.group(3), 16) & 1))


def format_traceparent(trace_id: int, span_id: int, *, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def parse_published_at(value: object, *, now: float) -> float | None:
    """The publish time a header carries, or None when it is missing, not a number, or not within a day
    of ``now`` (a clock that far off, or a forged value, would only draw a nonsense span)."""
    if not isinstance(value, str) or len(value) > 32:
        return None
    try:
        stamp = float(value)
    except ValueError:
        return None
    if not math.isfinite(stamp) or abs(stamp - now) > 86_400.0:
        return None
    return stamp


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\x1f".join(parts).encode()).digest()


def _non_zero(value: int) -> int:
    return value or 1


@lru_cache(maxsize=4096)
def checkpoint_trace_id(checkpoint_id: str) -> int:
    """The trace id of the snapshot (or restore) ``checkpoint_id``: the first 16 bytes of
    sha256("parkway-checkpoint", id)."""
    return _non_zero(int.from_bytes(_digest("parkway-checkpoint", checkpoint_id)[:16], "big"))


@lru_cache(maxsize=4096)
def checkpoint_span_id(checkpoint_id: str) -> int:
    """The span id of that trace's root span (the controller's ``snapshot`` or ``restore``)."""
    return _non_zero(int.from_bytes(_digest("parkway-checkpoint", checkpoint_id)[16:24], "big"))


def rollout_trace_id(rollout_id: str, attempt: int) -> int:
    """The trace id of one rollout attempt."""
    return _non_zero(int.from_bytes(_digest("parkway-rollout", rollout_id, str(attempt))[:16], "big"))


def rollout_span_id(rollout_id: str, attempt: int) -> int:
    """The span id of that attempt's root span (``rollout``)."""
    return _non_zero(int.from_bytes(_digest("parkway-rollout", rollout_id, str(attempt))[16:24], "big"))


def trace_id_hex(trace_id: int) -> str:
    return f"{trace_id:032x}"


def span_id_hex(span_id: int) -> str:
    return f"{span_id:016x}"
