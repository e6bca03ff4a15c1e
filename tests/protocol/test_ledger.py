"""The recovery ledger with plain objects: transition tables, identities, failures by granularity."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from parkway.protocol.ledger import (
    ATTEMPT_TRANSITIONS,
    GROUP_TRANSITIONS,
    Attempt,
    AttemptEvent,
    AttemptState,
    Granularity,
    Group,
    GroupEvent,
    GroupState,
    Ledger,
    LedgerError,
    SealOutcome,
)


@pytest.mark.parametrize(("state", "event"), list(itertools.product(AttemptState, AttemptEvent)))
def test_every_attempt_state_event_pair(state: AttemptState, event: AttemptEvent) -> None:
    attempt = Attempt(0, "g_g0", state=state)
    expected = ATTEMPT_TRANSITIONS.get((state, event))
    if expected is None:
        with pytest.raises(LedgerError, match=f"{event.value} is illegal in state {state.value}"):
            attempt.move(event)
        assert attempt.state is state
    else:
        attempt.move(event)
        assert attempt.state is expected


@pytest.mark.parametrize(("state", "event"), list(itertools.product(GroupState, GroupEvent)))
def test_every_group_state_event_pair(state: GroupState, event: GroupEvent) -> None:
    group = Group("g", 0, Granularity.SIBLING, [], state=state)
    expected = GROUP_TRANSITIONS.get((state, event))
    if expected is None:
        with pytest.raises(LedgerError):
            group.move(event)
    else:
        group.move(event)
        assert group.state is expected


def dispatch_all(ledger: Ledger) -> None:
    for sibling in ledger.reserved():
        ledger.dispatch(sibling.rollout_id, sibling.current.index, replica=0)


def test_ids_attempts_and_capture_keys() -> None:
    ledger = Ledger()
    group = ledger.add_group("t0007", 7, 3, Granularity.SIBLING)
    assert [s.rollout_id for s in group.siblings] == ["t0007_g0", "t0007_g1", "t0007_g2"]
    assert [s.current.capture_key for s in group.siblings] == ["t0007_g0", "t0007_g1", "t0007_g2"]
    dispatch_all(ledger)
    ledger.fail("t0007_g1", 0, code="injected")
    assert ledger.sibling("t0007_g1").current.capture_key == "t0007_g1-a1"
    with pytest.raises(LedgerError):
        ledger.add_group("t0007", 7, 3, Granularity.SIBLING)


def test_a_reserved_attempt_behind_the_gate_is_not_in_flight() -> None:
    ledger = Ledger()
    ledger.add_group("g", 0, 3, Granularity.SIBLING)
    assert ledger.in_flight() == 0 and len(ledger.reserved()) == 3
    ledger.dispatch("g_g0", 0, replica=1)
    assert ledger.in_flight() == 1 and len(ledger.reserved()) == 2


def test_sealing_settles_the_group_and_repeats_are_harmless() -> None:
    ledger = Ledger()
    ledger.add_group("g", 0, 2, Granularity.SIBLING)
    dispatch_all(ledger)
    assert ledger.seal("g_g0", 0, reward=1.0, turns=3) is SealOutcome.SEALED
    assert ledger.seal("g_g0", 0, reward=1.0, turns=3) is SealOutcome.DUPLICATE
    assert ledger.ready_groups() == []
    assert ledger.seal("g_g1", 0, reward=0.5, turns=4) is SealOutcome.SEALED
    assert [g.group_id for g in ledger.ready_groups()] == ["g"]
    ledger.finalize("g")
    ledger.remove("g")
    assert not ledger.knows("g_g0") and ledger.groups == {}


def test_under_sibling_only_the_failed_sibling_is_redone() -> None:
    ledger = Ledger(max_attempts=3)
    ledger.add_group("g", 0, 3, Granularity.SIBLING)
    dispatch_all(ledger)
    ledger.seal("g_g0", 0, reward=1.0, turns=5)
    plan = ledger.fail("g_g1", 0, code="injected", turns=2)
    assert plan.redo == ("g_g1",) and plan.retire == () and plan.given_up == ()
    assert [s.rollout_id for s in ledger.reserved()] == ["g_g1"]
    assert ledger.sibling("g_g0").current.state is AttemptState.SEALED  # kept
    assert ledger.sibling("g_g2").current.state is AttemptState.DISPATCHED  # untouched


def test_under_prompt_group_the_whole_group_is_redone_and_running_siblings_retired() -> None:
    ledger = Ledger(max_attempts=3)
    ledger.add_group("g", 0, 3, Granularity.PROMPT_GROUP)
    for i in range(3):
        ledger.dispatch(f"g_g{i}", 0, replica=i)
    ledger.seal("g_g0", 0, reward=1.0, turns=5)
    plan = ledger.fail("g_g1", 0, code="injected")
    assert plan.redo == ("g_g0", "g_g1", "g_g2")
    assert plan.retire == (("g_g2", 0, 2),)  # only the one still running needs stopping
    assert [a.state for a in ledger.sibling("g_g0").attempts] == [
        AttemptState.ABANDONED,
        AttemptState.RESERVED,
    ]
    assert ledger.sibling("g_g1").attempts[0].state is AttemptState.FAILED
    ledger.retired("g_g2", 0)
    assert ledger.sibling("g_g2").attempts[0].state is AttemptState.RETIRED
    # The abandoned attempt's late receipt is stale, not a seal.
    assert ledger.seal("g_g2", 0, reward=1.0, turns=5) is SealOutcome.STALE


def test_a_sibling_that_keeps_failing_is_given_up_as_a_typed_failure() -> None:
    ledger = Ledger(max_attempts=2)
    ledger.add_group("g", 0, 2, Granularity.SIBLING)
    dispatch_all(ledger)
    ledger.seal("g_g0", 0, reward=1.0, turns=5)
    assert ledger.fail("g_g1", 0, code="garbage").redo == ("g_g1",)
    dispatch_all(ledger)
    plan = ledger.fail("g_g1", 1, code="garbage")
    assert plan.given_up == ("g_g1",) and plan.redo == ()
    [group] = ledger.ready_groups()  # one failed sibling does not block its group's results
    assert [s.given_up for s in group.siblings] == [False, True]


def test_stale_failure_reports_change_nothing() -> None:
    ledger = Ledger()
    ledger.add_group("g", 0, 1, Granularity.SIBLING)
    dispatch_all(ledger)
    ledger.fail("g_g0", 0, code="x")
    assert ledger.fail("g_g0", 0, code="x").stale  # the same failure reported twice
    dispatch_all(ledger)
    assert ledger.in_flight() == 1


def test_dispatching_a_replaced_attempt_is_a_bug() -> None:
    ledger = Ledger()
    ledger.add_group("g", 0, 1, Granularity.SIBLING)
    dispatch_all(ledger)
    ledger.fail("g_g0", 0, code="x")
    with pytest.raises(LedgerError, match="not current"):
        ledger.dispatch("g_g0", 0, replica=0)


def test_restores_do_not_use_up_a_rollouts_retries() -> None:
    # Found by parkway chaos: rollouts restored twice (two crashes) and then failed once (a tool server
    # that lost its session) were given up, because every attempt counted, the restores' included.
    ledger = Ledger(max_attempts=2)
    ledger.add_group("g", 0, 1, Granularity.SIBLING)
    ledger.add_group("p", 1, 2, Granularity.PROMPT_GROUP)
    for _ in range(2):  # two crashes, each restored: turn level for g, prompt_group level for p
        dispatch_all(ledger)
        ledger.restart_after_restore("g_g0", continue_saved=True)
        ledger.redo_group_after_restore("p")
    dispatch_all(ledger)
    assert [len(ledger.sibling(r).attempts) for r in ("g_g0", "p_g0")] == [3, 3]
    assert ledger.fail("g_g0", 2, code="stale_attempt").redo == ("g_g0",)  # its first failure
    assert ledger.fail("p_g0", 2, code="stale_attempt").redo == ("p_g0", "p_g1")
    dispatch_all(ledger)
    assert ledger.fail("g_g0", 3, code="stale_attempt").given_up == ("g_g0",)  # the second: max_attempts
    assert ledger.fail("p_g1", 3, code="stale_attempt").given_up == ("p_g0", "p_g1")


def test_a_receipt_makes_its_attempt_sealing_until_its_seal_and_the_ledger_saves_it() -> None:
    ledger = Ledger()
    ledger.add_group("g", 0, 2, Granularity.SIBLING)
    dispatch_all(ledger)
    keys = ("g_g0:0", "g_g0:1")
    assert ledger.receive("g_g0", 0, reward=0.5, turns=2, staging_keys=keys) is SealOutcome.SEALED
    assert ledger.receive("g_g0", 0, reward=0.5, turns=2, staging_keys=keys) is SealOutcome.DUPLICATE
    # Finished on its agent: not running, still in flight for admission, the group not settled.
    assert ledger.dispatched() == {("g_g1", 0)} and ledger.in_flight() == 2
    assert [(s.rollout_id, a.index) for s, a in ledger.sealing()] == [("g_g0", 0)]
    saved = Ledger.load(ledger.export())
    (sibling, attempt), *_ = saved.sealing()
    assert (sibling.rollout_id, attempt.reward, attempt.turns, attempt.staging_keys) == ("g_g0", 0.5, 2, keys)
    assert saved.dispatched() == {("g_g1", 0)}
    # The seal after a restore, from the saved ledger: once.
    assert saved.seal("g_g0", 0, reward=0.5, turns=2) is SealOutcome.SEALED
    assert saved.seal("g_g0", 0, reward=0.5, turns=2) is SealOutcome.DUPLICATE
    assert saved.sealing() == [] and saved.groups["g"].state is GroupState.GENERATING
    assert saved.receive("g_g1", 0, reward=1.0, turns=1) is SealOutcome.SEALED
    assert saved.seal("g_g1", 0, reward=1.0, turns=1) is SealOutcome.SEALED
    assert saved.groups["g"].state is GroupState.READY_TO_FINALIZE


def test_a_sealing_attempt_fails_when_its_seal_is_refused_and_a_group_redo_abandons_it() -> None:
    ledger = Ledger()
    ledger.add_group("s", 0, 1, Granularity.SIBLING)
    ledger.add_group("p", 1, 2, Granularity.PROMPT_GROUP)
    dispatch_all(ledger)
    ledger.receive("s_g0", 0, reward=1.0, turns=1)
    assert ledger.fail("s_g0", 0, code="seal_refused").redo == ("s_g0",)
    assert ledger.sibling("s_g0").attempts[0].state is AttemptState.FAILED
    ledger.receive("p_g0", 0, reward=1.0, turns=1)
    plan = ledger.fail("p_g1", 0, code="injected")  # its sibling's failure redoes the group
    assert plan.redo == ("p_g0", "p_g1") and plan.retire == ()  # nothing of p_g0 runs on its agent
    assert ledger.sibling("p_g0").attempts[0].state is AttemptState.ABANDONED
    assert ledger.seal("p_g0", 0, reward=1.0, turns=1) is SealOutcome.STALE  # its seal comes back late


def encoded_whole(ledger: Ledger) -> bytes:
    """The ledger encoded group by group from scratch (what its export, which reuses unchanged groups'
    bytes, must equal)."""
    return msgspec.msgpack.encode(
        {"max_attempts": ledger.max_attempts, "groups": list(ledger.groups.values())}
    )


def scanned(ledger: Ledger, state: AttemptState) -> list[tuple[str, int]]:
    """The attempts in ``state``, by a scan of the whole ledger (what its index must agree with)."""
    return [(s.rollout_id, a.index) for s, a in ledger.attempts() if a.state is state]


@pytest.mark.parametrize("seed", range(20))
def test_the_index_and_the_export_agree_with_a_scan_after_any_moves(
    seed: int,
) -> None:
    # The ledger keeps its running, SEALING and ABANDONED attempts indexed at every move (the snapshot's
    # window and each dispatch ask for them). Random receipts, seals, failures, retirements, restores and group
    # removals, each followed by a full scan, and after a save and load.
    import random
    from collections import Counter

    rng = random.Random(seed)
    ledger = Ledger(max_attempts=3)
    for g in range(6):
        ledger.add_group(f"g{g}", g, 3, rng.choice(list(Granularity)))
    done: Counter[str] = Counter()
    instants: list[tuple[int, set[tuple[str, int]]]] = []  # (a dispatch mark, what ran at it)
    for _ in range(300):
        instants.append((ledger.dispatch_mark(), ledger.dispatched()))
        reserved = ledger.reserved()
        if reserved and rng.random() < 0.5:
            s = rng.choice(reserved)
            ledger.dispatch(s.rollout_id, s.current.index, replica=rng.randrange(2))
            done["dispatch"] += 1
        elif running := sorted(ledger.dispatched() | set(scanned(ledger, AttemptState.SEALING))):
            rollout, index = rng.choice(running)
            action = rng.choice(("receive", "seal", "fail", "restart", "redo_group", "place_on_policy"))
            done[action] += 1
            if action == "receive":
                ledger.receive(rollout, index, reward=1.0, turns=1)
            elif action == "seal":
                ledger.seal(rollout, index, reward=1.0, turns=1)
            elif action == "fail":
                ledger.fail(rollout, index, code="injected")
            elif action == "restart" and (rollout, index) in ledger.dispatched():
                ledger.restart_after_restore(rollout, continue_saved=True)
            elif action == "redo_group":
                ledger.redo_group_after_restore(ledger.group_of(rollout).group_id)
            elif action == "place_on_policy":
                ledger.place_on_policy(rollout, rng.randrange(3))
        for sibling in (s for g in ledger.groups.values() for s in g.siblings):
            for attempt in sibling.attempts:
                if attempt.state is AttemptState.ABANDONED and rng.random() < 0.3:
                    ledger.retired(sibling.rollout_id, attempt.index)
        for group in [g for g in ledger.groups.values() if g.state is GroupState.FINALIZING]:
            if rng.random() < 0.5:  # the trainer took it a while ago (an export may come between)
                ledger.remove(group.group_id)
                done["removed"] += 1
        for group in ledger.ready_groups():
            if rng.random() < 0.5:  # (or at a later step: an export may come between)
                ledger.finalize(group.group_id)
        assert ledger.dispatched() == set(scanned(ledger, AttemptState.DISPATCHED))
        # What ran at an earlier instant, told apart by its mark alone: still running, or dispatched since.
        mark, then = rng.choice(instants)
        assert ledger.dispatched_by(mark) == ledger.dispatched() & then
        assert ledger.dispatched_after(mark) == ledger.dispatched() - then
        assert sorted((s.rollout_id, a.index) for s, a in ledger.sealing()) == sorted(
            scanned(ledger, AttemptState.SEALING)
        )
        assert ledger.in_flight() == len(ledger.dispatched()) + len(ledger.sealing())
        assert {(s.rollout_id, a.index) for s, a in ledger.dispatched_attempts()} == ledger.dispatched()
        # The export reuses the bytes of every group that did not move: the same bytes as encoding all.
        assert ledger.export() == encoded_whole(ledger)
        abandoned = scanned(ledger, AttemptState.ABANDONED)
        assert sorted((s.rollout_id, a.index) for s, a in ledger.abandoned()) == sorted(abandoned)
        done["abandoned_held"] += bool(abandoned)
    loaded = Ledger.load(ledger.export())
    assert loaded.dispatched() == ledger.dispatched()
    assert [(s.rollout_id, a.index) for s, a in loaded.sealing()] == scanned(ledger, AttemptState.SEALING)
    assert [(s.rollout_id, a.index) for s, a in loaded.abandoned()] == scanned(ledger, AttemptState.ABANDONED)
    assert loaded.export() == ledger.export()
    moves = (
        "dispatch",
        "receive",
        "seal",
        "fail",
        "restart",
        "redo_group",
        "place_on_policy",
        "abandoned_held",
    )
    assert all(done[k] > 0 for k in moves), done
