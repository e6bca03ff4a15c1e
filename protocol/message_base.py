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
