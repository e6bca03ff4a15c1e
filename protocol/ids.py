"""Identities: checkpoint ids, actor addresses, rollout ids, capture keys and staging keys.

Each key has one builder and one parser here; nothing else spells or splits them:

- group id ``t<task index>`` (``t0003``): the rollouts of one task; ``t<task index>s<session>`` in a
  session started afresh on actors that served the run before (``t0003s1796187620``);
- rollout id ``<group id>_g<i>``: one rollout of a group, stable across its attempts;
- capture key ``<rollout id>`` for attempt 0, ``<rollout id>-a<N>`` for attempt N: one attempt's rows;
- staging key ``<capture key>:<turn>``: one model call's staging row.
"""

from __future__ import annotations

import re
import secrets
import time
from enum import StrEnum

from parkway.protocol.errors import ErrorCode, ProtocolError

# Nothing from a message becomes a path unless it matches this.
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


class Role(StrEnum):
    """Who an actor is. A role is also its name on the wire and in addresses (``agent/0``)."""

    CONTROLLER = "controller"
    AGENT = "agent"
    POLICY = "policy"
    RESOURCES = "resources"
    TQ = "tq"
    TRAINER = "trainer"  # hosts the trainer plugin; not a snapshot participant (anchored by step)


# The roles a snapshot holds, in the order a whole-cluster fan-out (abort, orphans, topology) walks them.
PARTICIPANT_ROLES: tuple[Role, ...] = (Role.AGENT, Role.POLICY, Role.RESOURCES, Role.TQ)


def actor_address(role: str, replica: int) -> str:
    """Where an actor's commands are routed: ``role/replica``."""
    return f"{role}/{replica}"


def parse_address(address: str) -> tuple[str, int]:
    role, sep, replica = address.partition("/")
    if not sep or not replica.isdigit():
        raise ValueError(f"address {address!r} is not ROLE/REPLICA")
    return validate_name(role, "role"), int(replica)


_GROUP_SEPARATOR = "_g"
_ATTEMPT_SEPARATOR = "-a"
_TURN_SEPARATOR = ":"


def _count(text: str) -> int | None:
    """A count as the builders write it (``0``, ``7``, ``12``), or None: no sign, no leading zero,
    ASCII digits only (``str.isdigit`` also takes ``²``, which ``int`` refuses)."""
    if not text or not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0"):
        return None
    return int(text)


_SESSION_SEPARATOR = "s"


def task_group_id(task_index: int, session: int = 0) -> str:
    """The group id of the ``task_index``-th task of a run: ``t0003``; sortable up to 10,000 tasks.

    ``session`` > 0: a session of the run started afresh on actors that served an earlier one
    (``t0003s1796187620``), so none of its ids is one those actors already answered."""
    if task_index < 0:
        raise ValueError(f"task index {task_index} is negative")
    if session < 0:
        raise ValueError(f"session {session} is negative")
    tag = f"{_SESSION_SEPARATOR}{session}" if session else ""
    return f"t{task_index:04d}{tag}"


def parse_group_session(group_id: str) -> tuple[int, int]:
    """(task index, session) of a group id: ``t0003`` -> (3, 0), ``t0003s17`` -> (3, 17)."""
    body, sep, tag = group_id.partition(_SESSION_SEPARATOR)
    digits = body[1:]
    if body[:1] != "t" or not digits.isascii() or not digits.isdigit():
        raise ValueError(f"group id {group_id!r} is not t<task index>[s<session>]")
    session = _count(tag) if sep else 0
    if session is None or (sep and session == 0):
        raise ValueError(f"group id {group_id!r}: session {tag!r} is not a positive count")
    index = int(digits)
    if task_group_id(index, session) != group_id:  # t003, t00012: not what the builder writes
        raise ValueError(f"group id {group_id!r} is not t<task index in four digits or more>")
    return index, session


def parse_task_group_id(group_id: str) -> int:
    """The task index of a group id: ``t0003`` -> 3 (``t12345`` past 10,000 tasks; ``t0003s2`` -> 3)."""
    return parse_group_session(group_id)[0]


def rollout_id(group_id: str, generation_index: int) -> str:
    """The logical rollout id, stable across retries: ``{group_id}_g{i}``."""
    return f"{group_id}{_GROUP_SEPARATOR}{generation_index}"


def parse_rollout_id(value: str) -> tuple[str, int]:
    """(group id, generation index) of a rollout id: ``t0003_g1`` -> (``t0003``, 1)."""
    group, sep, index = value.rpartition(_GROUP_SEPARATOR)
    generation = _count(index)
    if not sep or not group or generation is None:
        raise ValueError(f"rollout id {value!r} is not <group id>_g<index>")
    return group, generation


def capture_key(logical_rollout_id: str, attempt: int) -> str:
    """``<logical>`` for attempt 0, ``<logical>-a<N>`` after: each attempt's rows are kept apart."""
    if attempt < 0:
        raise ValueError(f"attempt {attempt} is negative")
    if not logical_rollout_id:
        raise ValueError("a capture key needs a rollout id")
    return logical_rollout_id if attempt == 0 else f"{logical_rollout_id}{_ATTEMPT_SEPARATOR}{attempt}"


def parse_capture_key(key: str) -> tuple[str, int]:
    """(logical rollout id, attempt) of a capture key: ``g_g1-a2`` -> (``g_g1``, 2), ``g_g1`` -> (``g_g1``, 0).

    Only what ``capture_key`` builds parses: ``g_g1-a0`` or ``g_g1-a02`` (attempt 0 has no suffix, a
    count no leading zero) and an empty rollout id raise ``ValueError``."""
    if not key:
        raise ValueError("capture key is empty")
    logical, sep, suffix = key.rpartition(_ATTEMPT_SEPARATOR)
    if not sep or not suffix.isascii() or not suffix.isdigit():
        return key, 0  # no attempt suffix: attempt 0
    attempt = _count(suffix)
    if not logical or attempt is None or attempt == 0:
        raise ValueError(
            f"capture key {key!r} is not <rollout id> (attempt 0) or <rollout id>-a<N> (N >= 1, no leading zero)"
        )
    return logical, attempt


def staging_key(capture: str, turn: int) -> str:
    """``<capture key>:<turn>``: the key of one model call's staging row (and of that call itself)."""
    if turn < 0:
        raise ValueError(f"turn {turn} is negative")
    if not capture:
        raise ValueError("a staging key needs a capture key")
    return f"{capture}{_TURN_SEPARATOR}{turn}"


def parse_staging_key(key: str) -> tuple[str, int]:
    """(capture key, turn) of a staging key: ``g_g1-a2:3`` -> (``g_g1-a2``, 3)."""
    capture, sep, text = key.rpartition(_TURN_SEPARATOR)
    turn = _count(text)
    if not sep or not capture or turn is None:
        raise ValueError(f"staging key {key!r} is not <capture key>:<turn>")
    return capture, turn
