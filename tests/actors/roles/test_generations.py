"""The policy's generation records: counted per (rollout, turn), kept across processes in one file,
scoped to the run's newest session."""

from __future__ import annotations

from pathlib import Path

import pytest
from parkway.actors.roles import generations
from parkway.actors.roles.generations import GenerationRecords, session_of


def test_records_survive_the_process_and_count_repeats(tmp_path: Path) -> None:
    journal = tmp_path / "policy" / "generations.log"
    first = GenerationRecords(journal)
    for rollout, turn in [("t0000_g0", 0), ("t0000_g0", 1), ("t0000_g1", 0)]:
        first.generated(rollout, turn)
    # Killed here; the next process reads what the dead one generated and counts the redone turn.
    with journal.open("a") as f:
        f.write("t0000_g1 ")  # a line cut short by the kill
    second = GenerationRecords(journal)
    assert (second.total, second.repeated) == (3, 0)
    second.generated("t0000_g0", 1)
    assert (second.total, second.repeated) == (4, 1)
    first.close()
    second.close()


def test_a_new_session_counts_from_zero_and_an_older_one_is_not_counted() -> None:
    records = GenerationRecords()
    records.generated("t0000_g0", 0)
    records.generated("t0000s17_g0", 0)  # the session started afresh: its ids, its counts
    assert (records.session, records.total, records.repeated) == (17, 1, 0)
    records.generated("t0000_g0", 1)  # a call of the earlier session, still queued
    assert (records.total, records.repeated) == (1, 0)
    assert session_of("not a rollout id") == 0


def test_a_snapshots_totals_are_adopted_only_when_they_know_more() -> None:
    records = GenerationRecords()
    records.adopt(0, 12, 2)  # a policy without a file, restored in a new process
    assert (records.total, records.repeated) == (12, 2)
    records.adopt(0, 5, 0)  # a journal that knows more keeps its own
    assert (records.total, records.repeated) == (12, 2)


def test_the_file_is_compacted_to_the_turns_still_counted_and_keeps_its_totals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(generations, "COMPACT_MIN_LINES", 10)
    journal = tmp_path / "generations.log"
    records = GenerationRecords(journal)
    for index in range(30):
        rollout = f"t{index:04d}s5_g0"
        records.generated(rollout, 0)
        records.generated(rollout, 1)
        if index % 3 == 0:
            records.generated(rollout, 1)  # regenerated
        if index < 29:
            records.forget({rollout})  # finished: only the totals keep it
    records.generated("t0029s5_g0", 1)
    assert (records.session, records.total, records.repeated) == (5, 71, 11)
    lines = journal.read_text().splitlines()
    # Bounded by what is still counted per turn, not by the 71 generations written.
    assert len(lines) <= 4 * 2 + 10
    assert lines[0].startswith("#totals 5 ")
    again = GenerationRecords(journal)
    assert (again.session, again.total, again.repeated) == (5, 71, 11)
    assert again.turns == records.turns == {("t0029s5_g0", 0): 1, ("t0029s5_g0", 1): 2}
    again.generated("t0029s5_g0", 2)
    assert (again.total, again.repeated) == (72, 11)
    records.close()
    again.close()


def test_a_malformed_totals_line_is_skipped(tmp_path: Path) -> None:
    journal = tmp_path / "generations.log"
    journal.write_text("#totals five 1 2\nt0000_g0 0\n")
    records = GenerationRecords(journal)
    assert (records.total, records.repeated) == (1, 0)
    records.close()


def test_a_foreign_rollout_id_of_any_characters_is_recorded_and_read_back(tmp_path: Path) -> None:
    # Found by the fuzz test: a Generate whose rollout id held non-ASCII characters made the policy's
    # handler fail (``internal``) writing this file; spaces or a newline would have broken its lines.
    odd = ["ü" * 50_000, "two words", "line\nbreak", "100%", "t0000_g0"]
    journal = tmp_path / "generations.log"
    first = GenerationRecords(journal)
    for rollout in odd:
        first.generated(rollout, 0)
    first.generated("line\nbreak", 0)
    first.forget({"two words"})
    first.close()
    again = GenerationRecords(journal)
    assert again.total == 6 and again.repeated == 1
    assert {r for r, _ in again.turns} == set(odd) - {"two words"}
    assert journal.read_text(encoding="ascii").count("\n") == 7  # one line each, all ASCII
    again.close()
