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


# Step records the trainer keeps in memory: the newest this many (a repeated Train is of the newest
# step or two; a sync to an older step reads its file). Each record holds the plugin's state and the
# step's reply, a digest per rollout trained: all of them would grow with every rollout of the run.
KEEP_IN_MEMORY = 16


class TrainerRecords:
    """The trainer actor's own records (``protocol.training.StepRecord``): one durable file per step in
    its state directory, written before the step is answered, the newest ``keep`` also in memory; with
    no directory only those are kept (an embedded run without snapshots: there is no restore to sync
    to an older step, and nothing outlives the process anyway)."""

    def __init__(self, directory: Path | None, *, keep: int = KEEP_IN_MEMORY) -> None:
        if keep < 1:
            raise ValueError(f"keep {keep}: want at least 1 record in memory")
        self.directory = directory
        self.keep = keep
        self._memory: dict[int, StepRecord] = {}  # the newest ``keep``, in step order
        self._last = 0
        self._fence = ""
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            steps = self._steps_on_disk()
            for step in steps[-keep:]:
                self._memory[step] = self._read(step)
            self._last = steps[-1] if steps else 0
            fence = directory / layout.TRAINER_FENCE_FILE
            if fence.exists():
                self._fence = msgspec.msgpack.decode(fence.read_bytes(), type=TrainerFence).session

    def _steps_on_disk(self) -> list[int]:
        assert self.directory is not None
        found = (layout.parse_trainer_state_file_name(p.name) for p in self.directory.iterdir())
        return sorted(step for step in found if step is not None)

    def _read(self, step: int) -> StepRecord:
        assert self.directory is not None
        path = self.directory / layout.trainer_state_file_name(step)
        return msgspec.msgpack.decode(path.read_bytes(), type=StepRecord)

    @property
    def last_step(self) -> int:
        return self._last

    @property
    def fence(self) -> str:
        return self._fence

    def in_memory(self) -> int:
        """Records held in memory (``structure_sizes``): at most ``keep``."""
        return len(self._memory)

    def get(self, step: int) -> StepRecord | None:
        record = self._memory.get(step)
        if record is not None or self.directory is None or not 0 < step <= self._last:
            return record
        try:
            return self._read(step)
        except FileNotFoundError:
            return None

    def steps(self) -> list[StepRecord]:
        """Every step kept, in order: the trainer's history of this run since its last rewind (from
        its files; with no directory, the newest ``keep``)."""
        if self.directory is None:
            return list(self._memory.values())
        return [self._read(s) for s in self._steps_on_disk()]

    def write(self, record: StepRecord) -> None:
        """Durable before it returns (file fsynced, renamed, directory fsynced)."""
        if self.directory is not None:
            replace_durably(
                self.directory / layout.trainer_state_file_name(record.step), msgspec.msgpack.encode(record)
            )
            fsync_dir(self.directory)
        self._memory.pop(record.step, None)
        self._memory[record.step] = record
        self._last = max(self._last, record.step)
        while len(self._memory) > self.keep:
            del self._memory[min(self._memory)]

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
        held = self._steps_on_disk() if self.directory is not None else list(self._memory)
        later = sorted((s for s in held if s > step), reverse=True)
        for s in later:
            if self.directory is not None:
                (self.directory / layout.trainer_state_file_name(s)).unlink(missing_ok=True)
            self._memory.pop(s, None)
        if later and self.directory is not None:
            fsync_dir(self.directory)
        self._last = max((s for s in held if s <= step), default=0)
        if self.directory is not None:  # the newest ``keep`` at or before ``step`` back in memory
            for s in sorted(s for s in held if s <= step)[-self.keep :]:
                if s not in self._memory:
                    self._memory[s] = self._read(s)
            self._memory = dict(sorted(self._memory.items()))
        return len(later)
