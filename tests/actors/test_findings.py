"""The bugs found in review of the design we follow (NeMo RL/Gym turn recovery) that must be impossible
here, one test each; docs/protocol.md#invariants states the rules they break.

Findings covered elsewhere: a row waiting behind the closed gate is not running
(``tests/protocol/test_ledger.py``), one failed row does not end its group's stream
(``tests/actors/launch/test_workload.py``), a lost resume costs seconds
(``tests/actors/runtime/test_participant.py``), a crash test that passes
although the episode started over (``tests/integration/test_crash_recovery.py`` asserts how many
rollouts continued and how few turns were generated again).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from parkway.actors.roles.agent import Agent
from parkway.actors.roles.controller.controller import RunSummary, SetupError, SimulatedCrash
from parkway.actors.runtime.participant import ParkReport
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import AttemptsFenced, Dispatched
from parkway.protocol.messages import Prepare
from parkway.protocol.snapshot import episode_mismatch

from tests.support.embedded import crash_after, embedded_run
from tests.support.restores import watch_ends

BASE = {
    "run": "findings",
    "seed": 5,
    "policy": {"host": "inline", "per_token_delay_s": 0.0003},
    "tasks": {"builtin": "bank", "limit": 2},
    "rollout": {"group_size": 3, "max_turns": 5},
    "snapshot_interval_s": 0.03,
}


async def run(state: Path, *, stop_after: int | None = None, **overrides: object) -> RunSummary:
    return await embedded_run({**BASE, **overrides}, state, stop_after=stop_after)


def record_history(monkeypatch, state: Path) -> None:
    """Every actor of the run records its history under ``state`` (what the checks below read)."""
    from parkway.actors.runtime.history import HISTORY_ENV

    monkeypatch.setenv(HISTORY_ENV, "1")
    monkeypatch.setenv("PARKWAY_STATE_DIR", str(state))


async def test_restart_only_servers_fail_setup_by_name(tmp_path: Path) -> None:
    with pytest.raises(SetupError) as info:
        await run(tmp_path, resources={"mode": "restart_only"})
    assert "resources/0, resources/1" in str(info.value) and "allow_restart_only" in str(info.value)


async def test_restart_only_servers_never_stall_a_snapshot(tmp_path: Path) -> None:
    # NeMo #4500-1: a restart-only server made every prepare time out. Here it reports its live
    # rollouts as restarts, the snapshot publishes, and after a crash those rollouts restart from the
    # prompt (sibling behaviour) while the run still completes.
    overrides = {"resources": {"mode": "restart_only"}, "recovery": {"allow_restart_only": True}}
    await crash_after({**BASE, **overrides}, tmp_path)
    resumed = await run(tmp_path, **overrides)
    assert resumed.restores == 1 and resumed.snapshots_failed == 0
    assert resumed.rollouts_restored == 0  # nothing continued: the tool state was not saved
    assert resumed.rollouts_sealed == 6 and resumed.mean_reward == 1.0


def agents_wait_with(monkeypatch, wait) -> None:
    """Every agent's Prepare goes through ``wait`` (in place of ``wait_until_parked``), never the cut
    at once (``parked_now``) that skips the wait when every rollout is parked already."""
    monkeypatch.setattr(Agent, "parked_now", lambda self, command: None)
    monkeypatch.setattr(Agent, "wait_until_parked", wait)


async def test_a_transient_participant_error_is_retried_not_fatal(tmp_path: Path, monkeypatch) -> None:
    # NeMo #4266-1: an HTTP 500 from a participant during a periodic snapshot ended the run.
    failures = {"left": 2}
    original = Agent.wait_until_parked

    async def flaky(self: Agent, command: Prepare) -> ParkReport:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise ProtocolError(ErrorCode.UNAVAILABLE, "injected 500")
        return await original(self, command)

    agents_wait_with(monkeypatch, flaky)
    summary = await run(tmp_path)
    assert summary.snapshots_failed >= 1 and summary.snapshots_published >= 1
    assert summary.rollouts_sealed == 6


async def test_transient_failures_in_a_row_end_the_run_only_when_configured(
    tmp_path: Path, monkeypatch
) -> None:
    async def always(self: Agent, command: Prepare) -> ParkReport:
        raise ProtocolError(ErrorCode.UNAVAILABLE, "injected 500")

    agents_wait_with(monkeypatch, always)
    slow = {"host": "inline", "per_token_delay_s": 0.002}
    with pytest.raises(RuntimeError) as info:
        await run(tmp_path / "limited", policy=slow, snapshots={"end_after_failures": 3})
    assert "3 snapshots failed in a row (snapshots.end_after_failures)" in str(info.value)
    assert "injected 500" in str(info.value)
    # The default: every snapshot fails, and the run it exists to protect completes anyway.
    summary = await run(tmp_path / "default", policy=slow, snapshots={"backoff_max_s": 0.05})
    assert summary.snapshots_failed >= 3 and summary.snapshots_published == 0
    assert summary.rollouts_sealed == summary.rollouts_expected and summary.rollouts_failed == 0


async def test_prompt_group_does_not_deadlock_snapshots(tmp_path: Path) -> None:
    # NeMo #4266-2: a finished sibling's ACK waited for its whole group while prepare waited for the ACK.
    summary = await run(
        tmp_path, recovery={"default_granularity": "prompt_group"}, faults={"fail_attempts": ["t0000_g1@0:2"]}
    )
    assert summary.snapshots_published >= 1 and summary.snapshots_failed == 0
    assert summary.rollouts_sealed == 6 and summary.rollouts_redone == 3


def test_a_mismatch_names_the_differing_episodes() -> None:
    # NeMo #4500-9: the mismatch error did not say which episodes differed.
    message = episode_mismatch({("a_g0", 0), ("a_g2", 1)}, {("a_g0", 0), ("a_g1", 0)})
    assert message == "dispatched but not saved: a_g1@0; saved but not dispatched: a_g2@1"
    assert episode_mismatch({("x", 0)}, {("x", 0)}) is None
    many = episode_mismatch(set(), {(f"r{i}", 0) for i in range(30)}, limit=3)
    assert many is not None and many.endswith("and 27 more")


async def test_a_failed_restore_is_cleaned_up_once_by_one_owner(tmp_path: Path, monkeypatch) -> None:
    # NeMo #4500-10: a failed restore resumed participants twice (Gym and RL both cleaned up).
    from parkway.actors.roles.resources import Resources

    await crash_after(BASE, tmp_path)

    async def broken(self: Resources, directory: Path, command: object) -> tuple:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "sessions file unreadable")

    monkeypatch.setattr(Resources, "install_snapshot", broken)
    seen = watch_ends(monkeypatch)
    with pytest.raises(Exception, match="sessions file unreadable"):
        await run(tmp_path)
    assert not [s for s in seen if s[1] == "resume"]  # nothing resumed a failed restore
    aborts = sorted(a for a, kind in seen if kind == "abort")
    assert aborts == sorted(set(aborts)) and "agent/0" in aborts  # each participant aborted exactly once


async def test_a_stalled_rollout_is_retried(tmp_path: Path, monkeypatch) -> None:
    from parkway.actors.roles.controller.dispatch import Dispatcher

    task_options = Dispatcher.task_options

    def hang_one(self, config, rollout, attempt, replica, continue_from=None):
        options = task_options(self, config, rollout, attempt, replica, continue_from)
        if rollout == "t0000_g1":
            options = msgspec.structs.replace(options, hold_at_turn=2)  # its first attempt hangs at turn 2
        return options

    monkeypatch.setattr(Dispatcher, "task_options", hang_one)
    summary = await run(
        tmp_path,
        rollout={"group_size": 3, "max_turns": 5, "stall_timeout_s": 0.6},
        snapshot_interval_s=3600.0,
    )
    assert summary.attempts_failed == 1 and summary.rollouts_redone == 1
    assert summary.rollouts_sealed == 6 and summary.sessions_leaked == 0


async def test_the_stall_watchdog_does_not_count_parked_time(tmp_path: Path, monkeypatch) -> None:
    # NeMo #4500-5: the watchdog kept counting while rollouts were parked, aborting healthy runs.
    import asyncio

    original = Agent.wait_until_parked

    async def slow_to_park(self: Agent, command: Prepare) -> ParkReport:
        await asyncio.sleep(0.8)  # every snapshot keeps the rollouts parked longer than the stall timeout
        return await original(self, command)

    agents_wait_with(monkeypatch, slow_to_park)
    summary = await run(
        tmp_path,
        rollout={"group_size": 3, "max_turns": 5, "stall_timeout_s": 0.6},
        policy={"host": "inline", "per_token_delay_s": 0.0005},
        snapshot_interval_s=0.05,
    )
    # The agents' cuts came back after longer than the stall timeout: parked beyond it.
    assert summary.snapshots_published >= 1 and summary.snapshot_steps_ms["prepared"] > 600
    assert summary.attempts_failed == 0 and summary.rollouts_sealed == 6


async def test_an_unanswered_resume_is_release_pending_and_resent_under_the_same_id(
    tmp_path: Path, monkeypatch
) -> None:
    # NeMo #4500-7: one lost resume held participants closed for the whole lease.
    from parkway.actors.roles.resources import Resources
    from parkway.protocol.messages import Resume

    seen: list[str] = []
    original = Resources.on_resume

    async def lose_the_first(self: Resources, command: Resume):
        seen.append(command.checkpoint_id)
        if seen.count(command.checkpoint_id) == 1:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "resume lost")
        return await original(self, command)

    monkeypatch.setattr(Resources, "on_resume", lose_the_first)
    summary = await run(tmp_path)
    assert summary.snapshots_published >= 1 and summary.snapshots_failed == 0  # published, then released
    assert summary.rollouts_sealed == 6
    retried = [cid for cid in set(seen) if seen.count(cid) > 1]
    assert retried and all(cid.startswith("ck-") for cid in retried)  # the same id, sent again


async def test_a_failed_verify_does_not_leak_the_session(tmp_path: Path, monkeypatch) -> None:
    # NeMo #4117: a transient verify failure left the resources session alive forever.
    from parkway.actors.sdk.environments import Environment, ToolError

    def broken_verify(self: Environment, calls: object) -> float:
        raise ToolError("verifier unavailable")

    monkeypatch.setattr(Environment, "verify", broken_verify)
    summary = await run(
        tmp_path, rollout={"group_size": 3, "max_turns": 5, "max_attempts": 1}, snapshot_interval_s=3600.0
    )
    assert summary.rollouts_failed == 6  # a typed failure each (verify_failed), not a fake sample
    assert summary.sessions_leaked == 0


async def test_a_model_error_during_a_snapshot_keeps_the_rollout_parked(tmp_path: Path, monkeypatch) -> None:
    # Found with vLLM: an error reply (not held like a reply) let a parked rollout fail between prepare and
    # commit, so the agent saved an attempt the ledger had already failed and the snapshot ended the run.
    # Forced, not hoped for: an agent holding a cut (from its Prepare to its Resume) lets go of it only
    # once a model call has come back as an error meanwhile (its rollouts run on after the cut).
    from parkway.actors.engines.ray_host import EnginePool
    from parkway.actors.roles.agent import Agent

    state = {"closed": False, "errors": 0}
    errored = asyncio.Event()
    close, release, generate = Agent.close_admission, Agent.release, EnginePool.generate

    async def closing(self: Agent) -> None:
        state["closed"] = True
        await close(self)

    async def releasing(self: Agent) -> None:
        if state["errors"] == 0:
            await asyncio.wait_for(errored.wait(), 60)  # (bounded: a run with no model call would hang)
        state["closed"] = False
        await release(self)

    async def dies_mid_checkpoint(self: EnginePool, request):
        result = await generate(self, request)
        if state["closed"] and state["errors"] < 3:
            state["errors"] += 1
            errored.set()
            raise RuntimeError("engine died")  # an internal error reply, which the policy does not hold
        return result

    monkeypatch.setattr(Agent, "close_admission", closing)
    monkeypatch.setattr(Agent, "release", releasing)
    monkeypatch.setattr(EnginePool, "generate", dies_mid_checkpoint)
    summary = await run(tmp_path, policy={"host": "inline", "per_token_delay_s": 0.002})
    assert state["errors"] >= 1  # errors really came back while an agent held its cut
    assert summary.snapshots_published >= 1 and summary.snapshots_failed == 0
    assert summary.rollouts_sealed == 6 and summary.attempts_failed == state["errors"]


async def test_a_participant_whose_lease_lapsed_fails_one_snapshot_not_the_run(
    tmp_path: Path, monkeypatch
) -> None:
    # Found by parkway chaos (a controller stopped with SIGSTOP in the middle of a snapshot): the
    # participants' leases lapsed, they resumed themselves and refused the Commit (stale_checkpoint), and
    # the controller took that for a broken protocol and ended the run. A lapsed lease is a timeout.
    import time

    from parkway.actors.runtime.participant import Participant
    from parkway.protocol.messages import Commit

    lapses = {"left": 1}
    on_commit = Agent.on_commit

    async def lapsed_first(self: Agent, command: Commit):
        if lapses["left"] > 0:
            lapses["left"] -= 1
            self.phases.lease_expires_at = time.time() - 1  # what a slow controller leaves behind
            transition = self.phases.lapse_if_expired(time.time())
            assert transition is not None
            await Participant._end(self, transition.checkpoint_id)
        return await on_commit(self, command)

    monkeypatch.setattr(Agent, "on_commit", lapsed_first)
    summary = await run(tmp_path)
    assert lapses["left"] == 0 and summary.snapshots_failed >= 1 and summary.snapshots_published >= 1
    assert summary.rollouts_sealed == 6


async def test_a_restore_fences_the_restored_ledgers_dead_attempts(tmp_path: Path, monkeypatch) -> None:
    # A restore drops every participant's fences (the dead cluster's may name attempt numbers the
    # restored ledger gives out again) and fences the restored timeline's: the attempts it restarts and
    # the ones that had failed before the snapshot.
    from parkway.actors.runtime.history import read_history

    record_history(monkeypatch, tmp_path)
    faults = {"fail_attempts": ["t0000_g1@0:0"]}  # attempt 0 fails at its first turn, attempt 1 redoes it
    # Slow enough for three snapshots: the rollouts run on while each is written and published.
    slower = {"host": "inline", "per_token_delay_s": 0.001}
    with pytest.raises(SimulatedCrash):
        await run(tmp_path, stop_after=3, faults=faults, policy=slower)
    summary = await run(tmp_path, faults=faults, policy=slower)
    assert summary.restores == 1 and summary.rollouts_sealed == 6
    [fenced] = [r for r in read_history(tmp_path / "history" / "findings") if r.kind == "fenced"]
    assert ["t0000_g1", 0] in fenced.fields["attempts"]  # failed before the snapshot: fenced again


async def test_a_failed_attempt_is_fenced_everywhere_before_its_next_attempt(
    tmp_path: Path, monkeypatch
) -> None:
    # An attempt its agent reported failed has ended there, but copies of its calls may still be on the
    # wire (requeued by a broker restart, resent by the agent's client): the seeded chaos run once saw
    # the policy start a requeued call of attempt 0 after attempt 1 was dispatched. So the policy, every
    # tool server and TQ fence attempt 0 before attempt 1 goes out.

    record_history(monkeypatch, tmp_path)
    summary = await run(tmp_path, faults={"fail_attempts": ["t0000_g1@0:1"]})  # fails at its second turn
    assert summary.attempts_failed == 1 and summary.rollouts_redone == 1 and summary.rollouts_sealed == 6
    assert fenced_before_the_redo(tmp_path) == {"policy/0", "resources/0", "resources/1", "tq/0"}


async def test_a_fence_waits_out_a_broker_restart(tmp_path: Path, monkeypatch) -> None:
    # The broker is down when the fence goes out (it was, in the chaos run: the failure was the
    # outage's): the participants behind it are alive, so the fence is tried again, not skipped.
    import structlog
    from parkway.actors.runtime.client import Client
    from parkway.brokers.base import BrokerError
    from parkway.protocol.messages import Retire

    record_history(monkeypatch, tmp_path)
    real_request = Client.request
    refused: list[str] = []

    async def request(self: Client, address: str, message, **kwargs):
        if isinstance(message, Retire) and message.checkpoint_id.startswith("fence-") and len(refused) < 2:
            refused.append(address)
            raise BrokerError(f"publish to {address!r} failed: the broker is down (test)")
        return await real_request(self, address, message, **kwargs)

    monkeypatch.setattr(Client, "request", request)
    with structlog.testing.capture_logs() as logs:
        summary = await run(tmp_path, faults={"fail_attempts": ["t0000_g1@0:1"]})
    assert refused == ["policy/0", "policy/0"], "the outage never met a fence: nothing was tested"
    assert summary.rollouts_redone == 1 and summary.rollouts_sealed == 6
    assert [e["participant"] for e in logs if e["event"] == "fence_retried"] == ["policy/0", "policy/0"]
    assert not [e for e in logs if e["event"] == "fence_not_sent"]
    assert "policy/0" in fenced_before_the_redo(tmp_path)


def fenced_before_the_redo(state: Path) -> set[str]:
    """The actors whose history fenced attempt 0 of t0000_g1 before attempt 1 was dispatched."""
    from parkway.actors.runtime.history import read_history

    records = read_history(state / "history" / "findings")
    [redo] = [
        r for r in records if isinstance(r, Dispatched) and (r.rollout_id, r.attempt) == ("t0000_g1", 1)
    ]
    return {
        r.actor
        for r in records
        if isinstance(r, AttemptsFenced) and ("t0000_g1", 0) in r.attempts and r.t < redo.t
    }


def participants_held_at_the_end(state: Path) -> dict[str, str]:
    """Each participant whose last phase change left it in a checkpoint: {actor: phase}."""
    from parkway.actors.runtime.history import read_history
    from parkway.protocol.history import PhaseChanged

    last: dict[str, str] = {}
    for record in read_history(state / "history" / BASE["run"]):
        if isinstance(record, PhaseChanged):
            last[record.actor] = record.after
    assert last, "no participant changed phase: no snapshot ran"
    return {actor: phase for actor, phase in last.items() if phase != "idle"}


async def test_a_run_that_ends_during_a_snapshot_leaves_no_participant_held(
    tmp_path: Path, monkeypatch
) -> None:
    # CI saw a run started again refused at its first Prepare (checkpoint_conflict): the session before
    # it had started a snapshot after its last rollout, while it was winding down, and cancelled its
    # snapshot loop with that snapshot between prepare and commit; the policy stayed prepared for the
    # id until its lease lapsed. Here a snapshot starts once the run loop has ended and gets past
    # prepare before the run stops: the run must finish it, not leave the participants held.
    import asyncio

    from parkway.actors.roles.controller import cut
    from parkway.actors.roles.controller.forget import Forgetting
    from parkway.actors.roles.controller.save import SAVE_STEPS, SaveSequence
    from parkway.protocol.snapshot import SaveStep

    record_history(monkeypatch, tmp_path)
    winding_down, prepared = asyncio.Event(), asyncio.Event()
    late = {"id": None}
    instant, prepare, flush = cut.instant, cut.prepare, Forgetting.flush

    async def flush_while_a_snapshot_prepares(self: Forgetting, *, tries: int = 1) -> None:
        winding_down.set()
        await flush(self, tries=tries)
        await prepared.wait()  # the run stops only once that snapshot is past prepare

    async def instant_late(self: SaveSequence, attempt, stages) -> None:
        if winding_down.is_set() and late["id"] is None:
            late["id"], attempt.force = attempt.checkpoint_id, True  # taken although nothing moved
        await instant(self, attempt, stages)

    async def prepare_then_linger(self: SaveSequence, attempt, stages) -> None:
        await prepare(self, attempt, stages)
        if attempt.checkpoint_id == late["id"]:
            prepared.set()
            await asyncio.sleep(0.2)  # a window for the run's end to cut in, were it to cancel here

    monkeypatch.setattr(Forgetting, "flush", flush_while_a_snapshot_prepares)
    monkeypatch.setitem(SAVE_STEPS, SaveStep.INSTANT, instant_late)
    monkeypatch.setitem(SAVE_STEPS, SaveStep.PREPARE, prepare_then_linger)
    summary = await run(tmp_path, snapshot_interval_s=0.05)
    assert summary.rollouts_sealed == 6 and late["id"] is not None and prepared.is_set()
    assert participants_held_at_the_end(tmp_path) == {}


async def test_a_participant_held_by_an_id_whose_end_was_lost_is_released(
    tmp_path: Path, monkeypatch
) -> None:
    # A controller that died between prepare and commit (or an Abort that never arrived) leaves a
    # participant prepared for an id no one will end before its lease lapses. The next Prepare it
    # refuses (checkpoint_conflict) is a transient failure, not an invariant broken: the controller
    # aborts the id it is held by there, and the next snapshot goes in.
    import time

    import structlog
    from parkway.protocol.phases import Event

    on_prepare = Agent.on_prepare
    left = {"ids": 1}

    async def held_by_a_dead_controller(self: Agent, command: Prepare):
        if left["ids"] > 0 and self.replica == 0:
            left["ids"] -= 1
            self.phases.apply(
                Event.PREPARE, "ck-of-a-dead-controller", now=time.time(), deadline=time.time() + 600
            )
        return await on_prepare(self, command)

    monkeypatch.setattr(Agent, "on_prepare", held_by_a_dead_controller)
    with structlog.testing.capture_logs() as logs:
        summary = await run(tmp_path)
    assert left["ids"] == 0 and summary.rollouts_sealed == 6
    assert summary.snapshots_failed >= 1 and summary.snapshots_published >= 1
    released = [e for e in logs if e["event"] == "held_id_aborted"]
    assert [(e["participant"], e["held"]) for e in released] == [("agent/0", "ck-of-a-dead-controller")]


async def test_a_held_id_that_ends_before_the_controller_looks_is_not_an_invariant_broken(
    tmp_path: Path, monkeypatch
) -> None:
    # CI's seeded chaos schedule: a Resume lost in a broker restart left TQ committed for an id, and
    # the next snapshot's Prepare there was refused (checkpoint_conflict). The lease of that id lapsed
    # between the refusal and the controller's look at what TQ was held by: it found nothing held, took
    # the conflict for an invariant broken and ended the run (exit 3). Here the held id ends right
    # after the refusal, every time: the snapshot fails once as transient and the run goes on.
    import time

    import structlog
    from parkway.protocol.phases import Event

    on_prepare = Agent.on_prepare
    left = {"ids": 1}

    async def held_until_just_after_the_refusal(self: Agent, command: Prepare):
        if left["ids"] == 0 or self.replica != 0:
            return await on_prepare(self, command)
        left["ids"] -= 1
        held = "ck-whose-resume-was-lost"
        self.phases.apply(Event.PREPARE, held, now=time.time(), deadline=time.time() + 600)
        try:
            return await on_prepare(self, command)  # refused: checkpoint_conflict
        finally:
            self.phases.apply(Event.LEASE_LAPSED, held, now=time.time())

    monkeypatch.setattr(Agent, "on_prepare", held_until_just_after_the_refusal)
    with structlog.testing.capture_logs() as logs:
        summary = await run(tmp_path)
    assert left["ids"] == 0 and summary.rollouts_sealed == 6
    assert summary.snapshots_failed >= 1 and summary.snapshots_published >= 1
    failed = [e for e in logs if e["event"] == "snapshot_failed"]
    assert "checkpoint_conflict" in failed[0]["detail"] and failed[0]["transient"] is True
    assert [(e["participant"], e["held"]) for e in logs if e["event"] == "held_id_ended"] == [
        ("agent/0", None)
    ]
    assert not [e for e in logs if e["event"] == "held_id_aborted"]  # nothing was left to abort


async def test_a_resume_that_meets_a_long_broker_outage_is_sent_until_it_arrives(
    tmp_path: Path, monkeypatch
) -> None:
    # The cause of the conflict above: the controller gave a Resume up after five quick tries (three
    # seconds), less than a broker restart takes, and left the participant held until its lease lapsed.
    # Here TQ cannot be reached by the first eight Resumes of the first snapshot: the ninth ends the id
    # there, no later snapshot is refused, and nothing is left held at the end.
    import structlog
    from parkway.actors.roles.controller import participants
    from parkway.actors.runtime.client import Client
    from parkway.brokers.base import BrokerError
    from parkway.protocol.messages import Resume

    record_history(monkeypatch, tmp_path)
    request = Client.request
    lost: list[str] = []

    async def resumes_lost(self: Client, address: str, message, **kwargs):
        first = not lost or lost[0] == getattr(message, "checkpoint_id", None)
        if isinstance(message, Resume) and address == "tq/0" and first and len(lost) < 8:
            lost.append(message.checkpoint_id)
            raise BrokerError("injected: the broker is restarting")
        return await request(self, address, message, **kwargs)

    monkeypatch.setattr(Client, "request", resumes_lost)
    monkeypatch.setattr(participants, "RESUME_PAUSE_S", 0.02)  # (the outage need not take seconds here)
    slower = {**BASE["policy"], "per_token_delay_s": 0.003}  # later snapshots to meet TQ
    with structlog.testing.capture_logs() as logs:
        summary = await run(tmp_path, prepare_timeout_s=30, policy=slower)
    assert len(lost) == 8 and summary.rollouts_sealed == 6
    assert summary.snapshots_failed == 0 and summary.snapshots_published >= 2
    pending = [e for e in logs if e["event"] == "published_release_pending"]
    assert [e["attempt"] for e in pending] == list(range(1, 9))
    assert not [e for e in logs if e["event"] in ("resume_given_up", "held_id_aborted", "held_id_ended")]
    assert participants_held_at_the_end(tmp_path) == {}
    assert resumed_by_its_resume(tmp_path, "tq/0", lost[0])


def resumed_by_its_resume(state: Path, actor: str, checkpoint_id: str) -> bool:
    """Whether ``actor`` ended ``checkpoint_id`` on a Resume (not a lapse or an abort)."""
    from parkway.actors.runtime.history import read_history
    from parkway.protocol.history import PhaseChanged

    ends = [
        r.event
        for r in read_history(state / "history" / BASE["run"])
        if isinstance(r, PhaseChanged)
        and r.actor == actor
        and r.checkpoint_id == checkpoint_id
        and r.after == "idle"
    ]
    return ends == ["resume"]


async def test_a_run_that_ends_on_an_error_mid_snapshot_aborts_that_snapshot(
    tmp_path: Path, monkeypatch
) -> None:
    # The other way a run's end cuts a snapshot off: an error ends the run (here the stall watchdog
    # breaks) while a snapshot is between prepare and commit. That snapshot is aborted everywhere on
    # the way out, so no participant waits out a lease for it.
    import asyncio

    from parkway.actors.roles.controller import cut
    from parkway.actors.roles.controller.dispatch import Dispatcher
    from parkway.actors.roles.controller.save import SAVE_STEPS, SaveSequence
    from parkway.protocol.snapshot import SaveStep

    record_history(monkeypatch, tmp_path)
    prepared, never = asyncio.Event(), asyncio.Event()
    prepare = cut.prepare

    async def prepare_then_hang(self: SaveSequence, attempt, stages) -> None:
        await prepare(self, attempt, stages)
        prepared.set()
        await never.wait()  # until the run's end cancels it

    async def watchdog_breaks(self: Dispatcher, fail) -> None:
        if prepared.is_set():
            raise RuntimeError("the watchdog broke")

    monkeypatch.setitem(SAVE_STEPS, SaveStep.PREPARE, prepare_then_hang)
    monkeypatch.setattr(Dispatcher, "check_stalls", watchdog_breaks)
    with pytest.raises(RuntimeError, match="the watchdog broke"):
        await run(tmp_path)
    assert prepared.is_set() and participants_held_at_the_end(tmp_path) == {}


def stalled_while_sealing(monkeypatch, *, before_tq: bool) -> None:
    """Attempt 0 of t0000_g1 is failed by the stall watchdog (retired on its agent, fenced everywhere,
    attempt 1 reserved) while its Completed receipt is being sealed: after TQ sealed its rows
    (``before_tq`` False: a late receipt), or before its SealRows reached TQ (True: one requeued)."""
    from parkway.actors.roles.controller.receipts import Receipts
    from parkway.protocol.messages import Failed

    seal_rows = Receipts._seal_rows

    async def watchdog_cuts_in(self: Receipts, receipt) -> bool:
        if (receipt.rollout_id, receipt.attempt) != ("t0000_g1", 0):
            return await seal_rows(self, receipt)
        replica = self._state.ledger.sibling(receipt.rollout_id).current.replica

        async def stalled() -> None:  # what Dispatcher.check_stalls does
            await self._retirement.retire(((receipt.rollout_id, 0, replica),))
            await self.fail(Failed(rollout_id=receipt.rollout_id, attempt=0, code="stalled"))

        if before_tq:
            await stalled()
            return await seal_rows(self, receipt)
        sealed = await seal_rows(self, receipt)
        await stalled()
        return sealed

    monkeypatch.setattr(Receipts, "_seal_rows", watchdog_cuts_in)


def tq_rows_of(state: Path, rollout: str) -> list[tuple[str, int, str | None]]:
    """TQ's canonical-row history of ``rollout``: (kind, attempt, the capture key it replaced)."""
    from parkway.actors.runtime.history import read_history
    from parkway.protocol.history import RowSealed, RowUnsealed

    return [
        (r.kind, r.attempt, r.replaced if isinstance(r, RowSealed) else None)
        for r in read_history(state / "history" / BASE["run"])
        if isinstance(r, RowSealed | RowUnsealed) and r.rollout_id == rollout
    ]


async def test_an_attempt_failed_while_its_rows_were_sealed_leaves_no_canonical_row(
    tmp_path: Path, monkeypatch
) -> None:
    # Found by parkway chaos (broker restarts at every save step): TQ sealed attempt 0's rows, the
    # receipt's processing was then overtaken by the stall watchdog, which failed attempt 0; attempt 1
    # sealed later and TQ replaced attempt 0's canonical row with its own. Now a fence drops the
    # canonical row of the attempt it fences: attempt 1's seal finds none to replace.

    record_history(monkeypatch, tmp_path)
    stalled_while_sealing(monkeypatch, before_tq=False)
    summary = await run(tmp_path)
    assert summary.rollouts_sealed == 6 and summary.rollouts_redone == 1
    assert tq_rows_of(tmp_path, "t0000_g1") == [
        ("sealed", 0, None),
        ("unsealed", 0, None),
        ("sealed", 1, None),
    ]


async def test_a_seal_that_reaches_tq_after_its_fence_is_refused(tmp_path: Path, monkeypatch) -> None:
    # The same race the other way round: the fence is at TQ before the seal (a SealRows requeued by a
    # broker restart). TQ refuses it (stale_attempt) and the controller counts the receipt stale.
    from parkway.actors.runtime.history import read_history
    from parkway.protocol.history import Receipt

    record_history(monkeypatch, tmp_path)
    stalled_while_sealing(monkeypatch, before_tq=True)
    summary = await run(tmp_path)
    assert summary.rollouts_sealed == 6 and summary.rollouts_redone == 1
    assert tq_rows_of(tmp_path, "t0000_g1") == [("sealed", 1, None)]
    receipts = [
        (r.attempt, r.of, r.outcome)
        for r in read_history(tmp_path / "history" / BASE["run"])
        if isinstance(r, Receipt) and r.rollout_id == "t0000_g1"
    ]
    assert (0, "completed", "fenced") in receipts and (1, "completed", "sealed") in receipts


async def test_a_receipt_whose_handling_failed_is_handled_when_resent(tmp_path: Path, monkeypatch) -> None:
    # Found by parkway chaos (a broker restart while the controller sealed a receipt's rows): the
    # Completed handler raised, its failure went into the reply cache under the receipt's id, and the
    # agent's every resend was answered from there. The rollout sat until the stall watchdog redid it
    # two minutes later. Now the resend is handled: attempt 0 seals, nothing is redone.
    from parkway.actors.roles.controller.receipts import Receipts
    from parkway.actors.runtime.settings import RECEIPT_RESEND_ENV
    from parkway.brokers.base import BrokerError

    monkeypatch.setenv(RECEIPT_RESEND_ENV, "0.05")
    seal_rows, failures = Receipts._seal_rows, {"left": 1}

    async def broker_gone_once(self: Receipts, receipt) -> bool:
        if (receipt.rollout_id, receipt.attempt) == ("t0000_g1", 0) and failures["left"] > 0:
            failures["left"] -= 1
            raise BrokerError("publish to 'tq/0' failed: the channel closed")
        return await seal_rows(self, receipt)

    monkeypatch.setattr(Receipts, "_seal_rows", broker_gone_once)
    summary = await run(tmp_path, rollout={**BASE["rollout"], "stall_timeout_s": 5})
    assert failures["left"] == 0 and summary.rollouts_sealed == 6
    assert summary.rollouts_redone == 0 and summary.attempts_failed == 0
