"""The participant phase machine, walked exhaustively with plain numbers for time."""

from __future__ import annotations

import itertools

import pytest
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.phases import TRANSITIONS, Event, Outcome, ParticipantPhases, Phase

NOW = 1000.0
LATER = NOW + 60.0
CID = "ck-1"

# How to bring a fresh machine into each phase with checkpoint id CID.
PATHS: dict[Phase, list[Event]] = {
    Phase.IDLE: [],
    Phase.PREPARING: [Event.PREPARE],
    Phase.PREPARED: [Event.PREPARE, Event.PARKED],
    Phase.COMMITTED: [Event.PREPARE, Event.PARKED, Event.COMMIT],
    Phase.RESTORED: [Event.RESTORE],
}


def machine_in(phase: Phase) -> ParticipantPhases:
    machine = ParticipantPhases(lease_grace_s=5.0)
    for event in PATHS[phase]:
        machine.apply(event, CID, now=NOW, deadline=LATER)
    assert machine.phase is phase
    return machine


def test_every_phase_is_reachable_and_every_event_named() -> None:
    assert set(PATHS) == set(Phase)
    assert {event for _, event in TRANSITIONS} == set(Event)


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)))
def test_every_phase_event_pair(phase: Phase, event: Event) -> None:
    machine = machine_in(phase)
    expected = TRANSITIONS.get((phase, event))
    if expected is not None:
        transition = machine.apply(event, CID, now=NOW, deadline=LATER)
        assert (transition.before, transition.after, transition.outcome) == (phase, expected, Outcome.MOVED)
        assert machine.phase is expected
        if expected is Phase.IDLE:
            assert machine.checkpoint_id is None and machine.lease_expires_at is None
            assert machine.ended_by(CID) is event
        else:
            assert machine.checkpoint_id == CID
    elif event is Event.ABORT:  # abort in idle: nothing active, the id is fenced
        assert machine.apply(event, CID, now=NOW).outcome is Outcome.FENCED
        assert machine.ended_by(CID) is Event.ABORT
    else:
        with pytest.raises(ProtocolError) as info:
            machine.apply(event, CID, now=NOW, deadline=LATER)
        assert info.value.code is ErrorCode.INVALID_PHASE
        assert machine.phase is phase  # an illegal event changes nothing


def test_check_reports_without_moving() -> None:
    machine = machine_in(Phase.PREPARED)
    assert machine.check(Event.COMMIT, CID, now=NOW, deadline=LATER).after is Phase.COMMITTED
    assert machine.phase is Phase.PREPARED


def test_a_late_prepare_of_an_aborted_id_is_stale() -> None:
    machine = machine_in(Phase.IDLE)
    machine.apply(Event.ABORT, CID, now=NOW)  # the abort overtook the prepare
    with pytest.raises(ProtocolError) as info:
        machine.apply(Event.PREPARE, CID, now=NOW, deadline=LATER)
    assert info.value.code is ErrorCode.STALE_CHECKPOINT
    assert "abort" in info.value.detail


@pytest.mark.parametrize("ended_by", [Event.RESUME, Event.ABORT])
def test_every_command_of_an_ended_id_is_stale_or_a_no_op(ended_by: Event) -> None:
    machine = machine_in(Phase.COMMITTED)
    machine.apply(ended_by, CID, now=NOW)
    for event in (Event.PREPARE, Event.RENEW, Event.COMMIT, Event.RESTORE):
        with pytest.raises(ProtocolError) as info:
            machine.apply(event, CID, now=NOW, deadline=LATER)
        assert info.value.code is ErrorCode.STALE_CHECKPOINT
    for event in (Event.RESUME, Event.ABORT):  # re-sent endings are harmless
        assert machine.apply(event, CID, now=NOW).outcome is Outcome.ALREADY_ENDED
    assert machine.phase is Phase.IDLE


def test_another_id_while_one_is_active_conflicts() -> None:
    machine = machine_in(Phase.PREPARED)
    for event in (Event.PREPARE, Event.COMMIT, Event.RENEW, Event.RESUME, Event.RESTORE):
        with pytest.raises(ProtocolError) as info:
            machine.apply(event, "ck-2", now=NOW, deadline=LATER)
        assert info.value.code is ErrorCode.CHECKPOINT_CONFLICT
    # Aborting another id fences that id and leaves the active one alone.
    assert machine.apply(Event.ABORT, "ck-2", now=NOW).outcome is Outcome.FENCED
    assert (machine.phase, machine.checkpoint_id) == (Phase.PREPARED, CID)


def test_a_command_past_its_deadline_is_refused() -> None:
    machine = machine_in(Phase.IDLE)
    with pytest.raises(ProtocolError) as info:
        machine.apply(Event.PREPARE, CID, now=NOW, deadline=NOW - 0.001)
    assert info.value.code is ErrorCode.DEADLINE_EXCEEDED
    assert info.value.retryable
    assert machine.phase is Phase.IDLE


def test_lease_is_deadline_plus_grace_and_renew_extends_it() -> None:
    machine = machine_in(Phase.IDLE)
    machine.apply(Event.PREPARE, CID, now=NOW, deadline=NOW + 10)
    assert machine.lease_expires_at == NOW + 15
    assert machine.lapse_if_expired(NOW + 14.9) is None
    machine.apply(Event.RENEW, CID, now=NOW + 9, deadline=NOW + 30)
    assert machine.lease_expires_at == NOW + 35
    assert machine.lapse_if_expired(NOW + 20) is None


def test_a_lapsed_lease_resumes_the_participant_and_fences_the_id() -> None:
    machine = machine_in(Phase.IDLE)
    machine.apply(Event.PREPARE, CID, now=NOW, deadline=NOW + 10)
    machine.apply(Event.PARKED, CID, now=NOW + 1)
    transition = machine.lapse_if_expired(NOW + 15)
    assert transition is not None
    assert (transition.before, transition.after) == (Phase.PREPARED, Phase.IDLE)
    assert machine.ended_by(CID) is Event.LEASE_LAPSED
    with pytest.raises(ProtocolError) as info:  # the controller's late commit cannot revive it
        machine.apply(Event.COMMIT, CID, now=NOW + 16, deadline=NOW + 60)
    assert info.value.code is ErrorCode.STALE_CHECKPOINT


def test_idle_has_no_lease_to_lapse() -> None:
    assert machine_in(Phase.IDLE).lapse_if_expired(NOW + 1e9) is None


def test_the_fence_remembers_a_bounded_number_of_ids() -> None:
    machine = ParticipantPhases(fence_memory=3)
    for i in range(5):
        machine.apply(Event.ABORT, f"ck-{i}", now=NOW)
    assert [machine.ended_by(f"ck-{i}") for i in range(5)] == [
        None,
        None,
        Event.ABORT,
        Event.ABORT,
        Event.ABORT,
    ]


@pytest.mark.parametrize("event", [Event.PREPARE, Event.RESTORE])
def test_a_lease_is_never_longer_than_max_lease_s_whatever_the_deadline(event: Event) -> None:
    phases = ParticipantPhases(lease_grace_s=1.0, max_lease_s=60.0)
    phases.apply(event, "ck-far", now=100.0, deadline=1e300)  # past the edge's checks, still bounded
    assert phases.lease_expires_at == 100.0 + 60.0 + 1.0
    phases.apply(Event.RENEW, "ck-far", now=150.0, deadline=float("inf"))
    assert phases.lease_expires_at == 150.0 + 60.0 + 1.0
    assert phases.lapse_if_expired(now=211.0) is not None and phases.phase is Phase.IDLE
