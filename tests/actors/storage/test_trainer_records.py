"""The trainer's step records stay bounded in memory (docs/memory.md#controller-and-trainer): the newest
``keep`` are held, an older one is read from its file, and a rewind brings the newest before it back."""

from __future__ import annotations

from pathlib import Path

from parkway.actors.storage.trainer import TrainerRecords
from parkway.protocol.training import StepRecord


def record(step: int) -> StepRecord:
    return StepRecord(step=step, session="s", groups=(f"t{step}",), state={"step": step}, reply=b"")


def test_memory_holds_the_newest_records_and_older_ones_are_read_from_disk(tmp_path: Path) -> None:
    records = TrainerRecords(tmp_path / "steps", keep=4)
    for step in range(1, 41):
        records.write(record(step))
    assert records.in_memory() == 4 and records.last_step == 40
    old = records.get(3)
    assert old is not None and old.groups == ("t3",)  # from its file
    assert [r.step for r in records.steps()] == list(range(1, 41))
    # A restarted trainer loads only the newest few.
    again = TrainerRecords(tmp_path / "steps", keep=4)
    assert again.in_memory() == 4 and again.last_step == 40
    assert again.drop_after(10) == 30
    assert again.last_step == 10 and again.in_memory() == 4
    assert [r.step for r in again.steps()] == list(range(1, 11))
    assert again.get(10) is not None and again.get(11) is None


def test_without_a_directory_only_the_newest_are_kept(tmp_path: Path) -> None:
    records = TrainerRecords(None, keep=3)
    for step in range(1, 11):
        records.write(record(step))
    assert records.in_memory() == 3 and records.last_step == 10
    assert records.get(2) is None and [r.step for r in records.steps()] == [8, 9, 10]
