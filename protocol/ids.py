"""Identities: checkpoint ids, actor addresses, rollout ids and capture keys."""

from __future__ import annotations

import re
import secrets
import time

from parkway.protocol.errors import ErrorCode, ProtocolError

# Nothing from a message becomes a path unless it matches this (SPEC section 8).
CHECKPOINT_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Run names and roles end up in queue names; keep them to a safe alphabet too.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


def is_valid_checkpoint_id(value: str) -> bool:
    return bool(CHECKPOINT_ID_PATTERN.fullmatch(value)) and value not in {".", ".."}


def validate_checkpoint_id(value: str) -> str:
    if not isinstance(value, str) or not is_valid_checkpoint_id(value):
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            f"checkpoint id {value!r} does not match {CHECKPOINT_ID_PATTERN.pattern}",
        )
    return value


def validate_name(value: str, what: str) -> str:
    if not NAME_PATTERN.fullmatch(value):
        raise ValueError(f"{what} {value!r} does not match {NAME_PATTERN.pattern}")
    return value


def new_checkpoint_id(prefix: str = "ck") -> str:
    """A fresh, sortable, path-safe id: prefix, UTC time to the millisecond, random suffix."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    millis = int(time.time() * 1000) % 1000
    return validate_checkpoint_id(f"{prefix}-{stamp}.{millis:03d}-{secrets.token_hex(3)}")


def actor_address(role: str, replica: int) -> str:
    """Where an actor's commands are routed: ``role/replica``."""
    return f"{role}/{replica}"


def parse_address(address: str) -> tuple[str, int]:
    role, sep, replica = address.partition("/")
    if not sep or not replica.isdigit():
        raise ValueError(f"address {address!r} is not ROLE/REPLICA")
    return validate_name(role, "role"), int(replica)


def rollout_id(group_id: str, generation_index: int) -> str:
    """The logical rollout id, stable across retries: ``{group_id}_g{i}``."""
    return f"{group_id}_g{generation_index}"


def capture_key(logical_rollout_id: str, attempt: int) -> str:
    """``<logical>`` for attempt 0, ``<logical>-a<N>`` after (SPEC section 4)."""
    if attempt < 0:
        raise ValueError(f"attempt {attempt} is negative")
    return logical_rollout_id if attempt == 0 else f"{logical_rollout_id}-a{attempt}"
