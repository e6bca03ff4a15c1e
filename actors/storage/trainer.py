"""A trainer checkpoint's two files: the controller's anchor at that step (the fallback marker) and
the trainer's own state. A restore falls back to them when the snapshot anchored at the step never
published."""

from __future__ import annotations

from typing import Any

import msgspec
from parkway.actors.storage.files import fsync_dir, replace_durably
from parkway.actors.storage.runs import RunDirectory
from parkway.protocol import layout
from parkway.protocol.anchor import ControllerAnchor, decode_anchor, encode_anchor


def write_trainer_checkpoint(
    run: RunDirectory, step: int, *, anchor: ControllerAnchor, state: dict[str, Any]
) -> None:
    """The fallback marker (what the trainer consumed so far) and the trainer's state, both durable,
    before the snapshot attempt anchored at this step."""
    run.trainer_dir.mkdir(parents=True, exist_ok=True)
    replace_durably(run.trainer_dir / layout.fallback_file_name(step), encode_anchor(anchor))
    replace_durably(run.trainer_dir / layout.trainer_state_file_name(step), msgspec.msgpack.encode(state))
    fsync_dir(run.trainer_dir)


def read_trainer_checkpoint(run: RunDirectory, step: int) -> tuple[ControllerAnchor, dict[str, Any]]:
    """The anchor and the trainer's state written at ``step``."""
    anchor = decode_anchor((run.trainer_dir / layout.fallback_file_name(step)).read_bytes())
    state = msgspec.msgpack.decode((run.trainer_dir / layout.trainer_state_file_name(step)).read_bytes())
    return anchor, state
