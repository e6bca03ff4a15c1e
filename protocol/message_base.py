"""The bases of every message (``messages.py`` holds the union): a tagged, versioned, strict Struct,
and a control command's checkpoint id and deadline. Apart so that modules of messages of their own
(``inspection.py``) can build on them without importing the union."""

from __future__ import annotations

import msgspec
from parkway.protocol import SCHEMA_VERSION, ranges
from parkway.protocol.ids import is_valid_checkpoint_id


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    """Base of every message. Subclasses are tagged with their class name."""

    v: int = SCHEMA_VERSION


class ControlCommand(Message, frozen=True, kw_only=True):
    checkpoint_id: str
    deadline: ranges.Deadline

    def __post_init__(self) -> None:
        if not is_valid_checkpoint_id(self.checkpoint_id):
            raise ValueError(f"checkpoint_id {self.checkpoint_id!r} is not a valid checkpoint id")


# A rollout id's bound, in UTF-8 bytes: the keys made of it (``<id>-a<N>:<index>``) are correlation ids,
# and AMQP carries a correlation id in at most 255 bytes.
MAX_ROLLOUT_ID_BYTES = 128


def check_attempt(rollout_id: str, attempt: int, call_index: int = 0) -> None:
    """The identity of a data message: a named rollout, an attempt and a call index, none negative."""
    if not rollout_id:
        raise ValueError("rollout_id is empty")
    if len(rollout_id.encode("utf-8", "surrogatepass")) > MAX_ROLLOUT_ID_BYTES:
        raise ValueError(f"rollout_id is longer than {MAX_ROLLOUT_ID_BYTES} bytes")
    if attempt < 0:
        raise ValueError(f"attempt {attempt} is negative")
    if call_index < 0:
        raise ValueError(f"call_index {call_index} is negative")
