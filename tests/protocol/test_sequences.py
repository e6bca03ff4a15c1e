"""The save and restore sequences are data the controller walks: every step has one implementation
(checked at import), and where a failure still aborts is read from them."""

from __future__ import annotations

import pytest
from parkway.protocol.snapshot import (
    NOT_ABORTED,
    RESTORE_ABORTABLE,
    RESTORE_SEQUENCE,
    SAVE_SEQUENCE,
    RestoreStep,
    SaveStep,
    Step,
    check_step_table,
    in_window,
    restore_failure_aborts,
    save_failure_aborts,
)


def test_a_table_with_a_step_missing_or_one_too_many_is_refused() -> None:
    check_step_table(SAVE_SEQUENCE, list(SaveStep))
    with pytest.raises(TypeError, match="no implementation of publish"):
        check_step_table(SAVE_SEQUENCE, [s for s in SaveStep if s is not SaveStep.PUBLISH])
    # A RestoreStep equals a SaveStep of the same value as a string: it is still not one.
    with pytest.raises(TypeError, match="implementations of no SaveStep: resume"):
        check_step_table(SAVE_SEQUENCE, [*SaveStep, RestoreStep.RESUME])
    with pytest.raises(TypeError, match="not every RestoreStep once"):
        check_step_table((*RESTORE_SEQUENCE, Step(RestoreStep.RESUME)), list(RestoreStep))


def test_a_save_aborts_at_every_step_but_the_release_of_its_cut() -> None:
    names = [step.name for step in SAVE_SEQUENCE]
    assert [s for s in names if not save_failure_aborts(s)] == [SaveStep.RESUME]
    assert {SaveStep.RESUME} == NOT_ABORTED
    # Failing after the window (the cuts coming back, writing, validating, publishing) aborts that
    # snapshot all the same: its agents are prepared from the window on.
    after = (SaveStep.PREPARED, SaveStep.CAPTURE, SaveStep.COMMIT, SaveStep.PERSIST, SaveStep.PUBLISH)
    assert all(save_failure_aborts(s) for s in after)


def test_the_window_holds_the_cuts_instant_and_nothing_that_waits_for_an_agent() -> None:
    window = [step.name for step in SAVE_SEQUENCE if in_window(step.name)]
    assert window == [SaveStep.INSTANT]
    before = [step.name for step in SAVE_SEQUENCE[: [s.name for s in SAVE_SEQUENCE].index(window[0])]]
    assert before == [SaveStep.RETIRE, SaveStep.ACK_DRAIN]
    after = [step.name for step in SAVE_SEQUENCE if not in_window(step.name) and step.name not in before]
    assert after == [
        SaveStep.PREPARE,
        SaveStep.PREPARED,
        SaveStep.DRAIN_RECEIPTS,
        SaveStep.CAPTURE,
        SaveStep.COMMIT,
        SaveStep.RESUME,
        SaveStep.PERSIST,
        SaveStep.VALIDATE,
        SaveStep.PUBLISH,
    ]


def test_every_participant_is_asked_at_once_in_each_participant_step() -> None:
    # One fan-out per step: a stage costs a round trip to its slowest member.
    for step in SAVE_SEQUENCE:
        assert len(step.stages) <= 1, step.name


def test_a_restore_aborts_while_participants_hold_its_id() -> None:
    aborting = [step.name for step in RESTORE_SEQUENCE if restore_failure_aborts(step.name)]
    assert aborting == [
        RestoreStep.RESTORE_PARTICIPANTS,
        RestoreStep.FENCE_PARTICIPANTS,
        RestoreStep.RESTORE_TQ,
        RestoreStep.FENCE_TQ,
    ]
    assert (aborting[0], aborting[-1]) == RESTORE_ABORTABLE
