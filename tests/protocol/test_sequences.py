"""The save and restore sequences are data the controller walks: every step has one implementation
(checked at import), and where a failure still aborts is read from them."""

from __future__ import annotations

import pytest
from parkway.protocol.snapshot import (
    ABORTABLE_UNTIL,
    RESTORE_ABORTABLE,
    RESTORE_SEQUENCE,
    SAVE_SEQUENCE,
    RestoreStep,
    SaveStep,
    Step,
    check_step_table,
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


def test_a_save_aborts_up_to_and_including_its_publish() -> None:
    names = [step.name for step in SAVE_SEQUENCE]
    until = names.index(ABORTABLE_UNTIL)
    assert [s for s in names if save_failure_aborts(s)] == names[: until + 1]
    assert not save_failure_aborts(SaveStep.RESUME) and save_failure_aborts(SaveStep.PUBLISH)


def test_a_restore_aborts_while_participants_hold_its_id() -> None:
    aborting = [step.name for step in RESTORE_SEQUENCE if restore_failure_aborts(step.name)]
    assert aborting == [
        RestoreStep.RESTORE_PARTICIPANTS,
        RestoreStep.FENCE_PARTICIPANTS,
        RestoreStep.RESTORE_TQ,
        RestoreStep.FENCE_TQ,
    ]
    assert (aborting[0], aborting[-1]) == RESTORE_ABORTABLE
