"""The life of a cut between a snapshot's Commit and its Persist (``protocol/cuts.py``), with plain
values: no participant, no broker."""

from __future__ import annotations

import pytest
from parkway.protocol.cuts import CutPhase, CutTable
from parkway.protocol.errors import ErrorCode, ProtocolError


def test_a_cut_is_taken_written_and_let_go() -> None:
    table: CutTable[str] = CutTable()
    table.take("ck-1", "rows")
    assert table.phase("ck-1") is CutPhase.TAKEN and table.holding() == 1
    assert table.persist("ck-1") == "rows"
    assert table.phase("ck-1") is CutPhase.WRITING
    table.written("ck-1")
    assert table.phase("ck-1") is CutPhase.WRITTEN
    assert table.holding() == 0  # the files hold it now


def test_persist_without_a_cut_is_a_stale_checkpoint() -> None:
    table: CutTable[str] = CutTable()
    with pytest.raises(ProtocolError) as refused:
        table.persist("ck-never")
    assert refused.value.code is ErrorCode.STALE_CHECKPOINT
    table.take("ck-1", "rows")
    assert table.drop("ck-1")  # aborted
    with pytest.raises(ProtocolError) as refused:
        table.persist("ck-1")
    assert refused.value.code is ErrorCode.STALE_CHECKPOINT


@pytest.mark.parametrize(
    ("steps", "illegal"),
    [
        (["take"], "take"),  # the same id cut twice
        (["take", "persist"], "persist"),  # written twice at once
        (["take"], "written"),  # written before a Persist asked for it
        (["take", "persist", "written"], "persist"),  # a Persist after the write is answered from the cache
    ],
)
def test_illegal_moves_raise_invalid_phase(steps: list[str], illegal: str) -> None:
    table: CutTable[str] = CutTable()
    moves = {"take": lambda: table.take("ck-1", "x"), "persist": lambda: table.persist("ck-1")}
    moves["written"] = lambda: table.written("ck-1")
    for step in steps:
        moves[step]()
    with pytest.raises(ProtocolError) as refused:
        moves[illegal]()
    assert refused.value.code is ErrorCode.INVALID_PHASE


def test_a_failed_write_holds_the_cut_for_the_abort_or_a_retry() -> None:
    table: CutTable[str] = CutTable()
    table.take("ck-1", "rows")
    table.persist("ck-1")
    table.failed("ck-1")  # a full disk
    assert table.phase("ck-1") is CutPhase.TAKEN and table.persist("ck-1") == "rows"
    assert table.drop("ck-1") and table.phase("ck-1") is None


def test_only_the_newest_cuts_are_kept() -> None:
    table: CutTable[int] = CutTable(kept=2)
    for n in range(4):
        table.take(f"ck-{n}", n)
    assert [table.phase(f"ck-{n}") for n in range(4)] == [None, None, CutPhase.TAKEN, CutPhase.TAKEN]
    assert len(table) == 2
