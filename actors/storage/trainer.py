"""A trainer checkpoint's two files: the controller's anchor at that step (the fallback marker) and
the trainer's own state. A restore falls back to them when the snapshot anchored at the step never
published. And the trainer actor's own step records (``TrainerRecords``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from parkway.actors.storage.files import fsync_dir, replace_durably
from parkway.actors.storage.runs import RunDirectory
from parkway.protocol import layout
from parkway.protocol.anchor import ControllerAnchor, decode_anchor, encode_anchor
from parkway.protocol.training import StepRecord, TrainerFence


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


class TrainerRecords:
    """The trainer actor's own records (``protocol.training.StepRecord``): one durable file per step in
    its state directory, written before the step is answered; with no directory, kept in memory (an
    embedded run without snapshots: nothing outlives the process anyway)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._memory: dict[int, StepRecord] = {}
        self._fence = ""
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            for path in directory.iterdir():
                if layout.parse_trainer_state_file_name(path.name) is None:
                    continue
                record = msgspec.msgpack.decode(path.read_bytes(), type=StepRecord)
                self._memory[record.step] = record
            fence = directory / layout.TRAINER_FENCE_FILE
            if fence.exists():
                self._fence = msgspec.msgpack.decode(fence.read_bytes(), type=TrainerFence).session

    @property
    def last_step(self) -> int:
        return max(self._memory, default=0)

    @property
    def fence(self) -> str:
        return self._fence

    def get(self, step: int) -> StepRecord | None:
        return self._memory.get(step)

    def steps(self) -> list[StepRecord]:
        """Every step kept, in order: the trainer's history of this run since its last rewind."""
        return [self._memory[s] for s in sorted(self._memory)]

    def write(self, record: StepRecord) -> None:
        """Durable before it returns (file fsynced, renamed, directory fsynced)."""
        if self.directory is not None:
            replace_durably(
                self.directory / layout.trainer_state_file_name(record.step), msgspec.msgpack.encode(record)
            )
            fsync_dir(self.directory)
        self._memory[record.step] = record

    def set_fence(self, session: str) -> None:
        if self.directory is not None:
            replace_durably(
                self.directory / layout.TRAINER_FENCE_FILE,
                msgspec.msgpack.encode(TrainerFence(session=session)),
            )
            fsync_dir(self.directory)
        self._fence = session

    def drop_after(self, step: int) -> int:
        """Forget every step after ``step`` (a restore trains them again); how many were dropped. The
        newest goes first, so a crash half-way leaves a contiguous history that a retry shortens."""
        later = sorted((s for s in self._memory if s > step), reverse=True)
        for s in later:
            if self.directory is not None:
                (self.directory / layout.trainer_state_file_name(s)).unlink(missing_ok=True)
            del self._memory[s]
        if later and self.directory is not None:
            fsync_dir(self.directory)
        return len(later)
