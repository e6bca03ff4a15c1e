"""An agent's Prepare: answered in the step it came in when every rollout can be cut already
(``parked_now``), waited for otherwise (a Run on its way, a rollout between boundaries), and what a
cut takes of each rollout, made once as it passes a boundary; the controller's scopes, made once per
running attempt."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from parkway.actors.roles.agent import Agent
from parkway.actors.roles.attempt import Attempt, CutEntry
from parkway.actors.roles.controller.scopes import DispatchedScopes
from parkway.actors.runtime import participant
from parkway.actors.runtime.tracing import NO_ROLLOUT_TRACE
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol import cut_changes
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.ledger import Granularity, Ledger
from parkway.protocol.messages import Abort, AttemptRef, EpisodeRef, Message, Prepare, Prepared, Run
from parkway.protocol.snapshot import SnapshotFailure
from parkway.protocol.transcript import ModelStep, SavedRollout, ToolStep

from tests.support.embedded import SNAPSHOT_RUN, embedded_run
from tests.support.signed import SECRET

RUN = "agentprepare"


class ParkedRollout:
    """What an agent's cut reads of a live rollout: its saved transcript and ref, and its trace."""

    def __init__(self, rollout_id: str, tools: int) -> None:
        self.saved = object()  # the cut keeps a reference; only Persist encodes it
        self.ref = EpisodeRef(rollout_id=rollout_id, attempt=0, replica=0, tools=tools)
        self.trace = NO_ROLLOUT_TRACE

    @property
    def cut_entry(self) -> CutEntry:  # (a test passes a boundary by giving it another ref)
        return CutEntry(self.saved, self.ref, self.trace)  # type: ignore[arg-type]  # a stand-in transcript


def prepare(*rollouts: str) -> Prepare:
    return Prepare(
        checkpoint_id="ck-prepare",
        deadline=time.time() + 30,
        episodes=tuple(EpisodeRef(rollout_id=r, attempt=0, replica=0) for r in rollouts),
    )


@pytest.fixture
def no_wait(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records every Prepare that went to the wait (``wait_parked``) instead of being answered at once."""
    waited: list[str] = []
    wait = participant.wait_parked

    async def recorded(p: participant.Participant, command: Prepare, ended: asyncio.Event):
        waited.append(command.checkpoint_id)
        return await wait(p, command, ended)

    monkeypatch.setattr(participant, "wait_parked", recorded)
    yield waited


async def test_a_prepare_finding_every_rollout_parked_is_answered_at_once(no_wait: list[str]) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        agent = Agent(broker, secret=SECRET)
        rollouts = {("a_g0", 0): ParkedRollout("a_g0", 2), ("a_g1", 0): ParkedRollout("a_g1", 0)}
        for (rollout_id, attempt), live in rollouts.items():
            agent.latest_attempt[rollout_id] = attempt
            agent.live[(rollout_id, attempt)] = live  # type: ignore[assignment]
        reply = await agent.on_prepare(prepare("a_g0", "a_g1"))
        assert isinstance(reply, Prepared) and no_wait == []
        # The cut names each rollout by the ref its boundary made (its tool calls there), not a copy.
        assert [id(e) for e in reply.episodes] == [id(live.ref) for live in rollouts.values()]
        assert reply.parked == 2 and agent.cut_taken.is_set()


async def test_a_prepare_naming_a_run_not_yet_arrived_waits_for_it(no_wait: list[str]) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        agent = Agent(broker, secret=SECRET)
        agent.latest_attempt["a_g0"] = 0
        agent.live[("a_g0", 0)] = ParkedRollout("a_g0", 1)  # type: ignore[assignment]
        prepared = asyncio.ensure_future(agent.on_prepare(prepare("a_g0", "a_g1")))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not prepared.done() and no_wait == ["ck-prepare"] and not agent.cut_taken.is_set()
        # The Run arrives (the agent knows the attempt now) and runs to its first boundary.
        agent.latest_attempt["a_g1"] = 0
        agent.live[("a_g1", 0)] = ParkedRollout("a_g1", 0)  # type: ignore[assignment]
        agent._park_changed.set()
        reply = await asyncio.wait_for(prepared, 5)
        assert isinstance(reply, Prepared)
        assert {(e.rollout_id, e.attempt) for e in reply.episodes} == {("a_g0", 0), ("a_g1", 0)}


async def test_a_prepare_meeting_a_rollout_between_boundaries_waits_for_its_boundary(
    no_wait: list[str],
) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        agent = Agent(broker, secret=SECRET)
        agent.latest_attempt["a_g0"] = 0
        agent.live[("a_g0", 0)] = ParkedRollout("a_g0", 3)  # type: ignore[assignment]
        agent._unready.add(("a_g0", 0))  # in a tool round its environment keeps no copy of
        prepared = asyncio.ensure_future(agent.on_prepare(prepare("a_g0")))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not prepared.done() and no_wait == ["ck-prepare"]
        agent._unready.discard(("a_g0", 0))
        agent._park_changed.set()
        reply = await asyncio.wait_for(prepared, 5)
        assert isinstance(reply, Prepared) and [e.tools for e in reply.episodes] == [3]


def dispatched(siblings: int, *, agents: int) -> Ledger:
    """One group of ``siblings`` rollouts of task t0001, dispatched to the agents in turn."""
    ledger = Ledger()
    ledger.add_group("t0001", 1, siblings, Granularity.SIBLING)
    for index, sibling in enumerate(ledger.reserved()):
        ledger.dispatch(sibling.rollout_id, sibling.current.index, replica=index % agents)
    return ledger


def test_a_scope_names_the_running_attempts_of_each_agent_and_no_ended_one() -> None:
    ledger = dispatched(3, agents=2)
    scopes = DispatchedScopes()
    first = scopes.of(ledger, ledger.dispatch_mark())
    assert {a: [(e.rollout_id, e.attempt, e.replica) for e in refs] for a, refs in first.items()} == {
        "agent/0": [("t0001_g0", 0, 0), ("t0001_g2", 0, 0)],
        "agent/1": [("t0001_g1", 0, 1)],
    }
    ledger.receive("t0001_g0", 0, reward=1.0, turns=3)  # it finished: no Prepare names it again
    second = scopes.of(ledger, ledger.dispatch_mark())
    assert [e.rollout_id for e in second["agent/0"]] == ["t0001_g2"]
    assert second["agent/0"][0] == first["agent/0"][1] and second["agent/1"] == first["agent/1"]
    # Made from the ledger's index alone: a scope with nothing kept from before names the same.
    assert DispatchedScopes().of(ledger, ledger.dispatch_mark()) == second


def test_a_scope_made_after_the_instant_names_only_what_was_dispatched_by_its_mark() -> None:
    ledger = dispatched(2, agents=1)
    mark = ledger.dispatch_mark()  # the instant
    ledger.add_group("t0002", 2, 1, Granularity.SIBLING)
    ledger.dispatch("t0002_g0", 0, replica=0)  # admission open again: dispatched after it
    named = DispatchedScopes().of(ledger, mark)["agent/0"]
    assert [e.rollout_id for e in named] == ["t0001_g0", "t0001_g1"]
    assert ledger.dispatched_after(mark) == {("t0002_g0", 0)}


def cut(checkpoint_id: str, *attempts: tuple[str, int]) -> Prepared:
    """An agent's whole cut, as its Prepared says it."""
    refs = tuple(EpisodeRef(rollout_id=r, attempt=a, replica=0) for r, a in attempts)
    return Prepared(checkpoint_id=checkpoint_id, parked=len(refs), episodes=refs)


def test_a_prepare_names_only_the_attempts_its_agents_last_cut_did_not_hold() -> None:
    ledger = dispatched(4, agents=2)
    scopes = DispatchedScopes()
    assert [e.rollout_id for e in scopes.of(ledger, ledger.dispatch_mark())["agent/0"]] == [
        "t0001_g0",
        "t0001_g2",
    ]
    assert scopes.base_of("agent/0") == ""
    # agent/0 answered a Prepare holding g0: it has that Run, so the next Prepare waits for g2 only.
    scopes.cut_of("agent/0", cut("ck-1", ("t0001_g0", 0)))
    second = scopes.of(ledger, ledger.dispatch_mark())
    assert [e.rollout_id for e in second["agent/0"]] == ["t0001_g2"] and scopes.base_of("agent/0") == "ck-1"
    assert [e.rollout_id for e in second["agent/1"]] == ["t0001_g1", "t0001_g3"]  # its own cut counts
    # A cut replaces the one before: g0 is not in it (it ended there, its receipt on the wire).
    scopes.cut_of("agent/0", cut("ck-2", ("t0001_g2", 0)))
    assert [e.rollout_id for e in scopes.of(ledger, ledger.dispatch_mark())["agent/0"]] == ["t0001_g0"]
    # Every Run agent/0 holds was in its last cut: its Prepare names nothing to wait for.
    scopes.cut_of("agent/0", cut("ck-3", ("t0001_g0", 0), ("t0001_g2", 0)))
    assert "agent/0" not in scopes.of(ledger, ledger.dispatch_mark())
    # Its agent restarted: the rollout's new attempt is a key no cut held, named until one holds it.
    ledger.restart_after_restore("t0001_g2", continue_saved=False)
    ledger.dispatch("t0001_g2", 1, replica=0)
    assert [(e.rollout_id, e.attempt) for e in scopes.of(ledger, ledger.dispatch_mark())["agent/0"]] == [
        ("t0001_g2", 1)
    ]


def test_the_controller_makes_an_agents_whole_cut_from_the_changes_it_answers_with() -> None:
    scopes = DispatchedScopes()
    first = scopes.cut_of("agent/0", cut("ck-1", ("a", 0), ("b", 0), ("c", 0)))
    assert list(first) == [("a", 0), ("b", 0), ("c", 0)]
    moved = EpisodeRef(rollout_id="b", attempt=0, replica=0, tools=2)  # b passed a boundary
    new = EpisodeRef(rollout_id="d", attempt=0, replica=0)
    changes = Prepared(
        checkpoint_id="ck-2",
        parked=3,
        episodes=(moved, new),
        base="ck-1",
        gone=(AttemptRef(rollout_id="a", attempt=0),),
    )
    whole = scopes.cut_of("agent/0", changes)
    assert whole == {("b", 0): moved, ("c", 0): first[("c", 0)], ("d", 0): new}
    assert scopes.base_of("agent/0") == "ck-2"
    # Changes against a cut the controller does not hold: refused, and the next Prepare names no base.
    stale = Prepared(checkpoint_id="ck-3", episodes=(new,), base="ck-1")
    with pytest.raises(SnapshotFailure, match="agent/0: changes against the cut of ck-1") as refused:
        scopes.cut_of("agent/0", stale)
    assert refused.value.transient and refused.value.step == "prepared"


def test_after_a_failed_snapshot_every_prepare_names_every_run_and_no_base() -> None:
    ledger = dispatched(2, agents=1)
    scopes = DispatchedScopes()
    scopes.cut_of("agent/0", cut("ck-1", ("t0001_g0", 0), ("t0001_g1", 0)))
    assert scopes.prepares(ledger, ledger.dispatch_mark(), "ck-2", time.time() + 30)("agent/0").episodes == ()
    scopes.forget()  # (what a failed snapshot does: its agents may not hold the cut kept of them)
    prepare = scopes.prepares(ledger, ledger.dispatch_mark(), "ck-3", time.time() + 30)("agent/0")
    assert prepare.base == "" and [e.rollout_id for e in prepare.episodes] == ["t0001_g0", "t0001_g1"]
    assert scopes.base_of("agent/0") == ""


async def test_an_agent_answers_with_what_changed_since_the_cut_the_prepare_names() -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        agent = Agent(broker, secret=SECRET)
        rollouts = {(r, 0): ParkedRollout(r, 0) for r in ("a_g0", "a_g1", "a_g2", "a_g3", "a_g4")}
        for (rollout_id, attempt), live in rollouts.items():
            agent.latest_attempt[rollout_id] = attempt
            agent.live[(rollout_id, attempt)] = live  # type: ignore[assignment]

        async def prepared(checkpoint_id: str, base: str) -> Prepared:
            command = Prepare(checkpoint_id=checkpoint_id, deadline=time.time() + 30, base=base)
            reply = await agent.on_prepare(command)
            assert isinstance(reply, Prepared)
            await agent.on_abort(Abort(checkpoint_id=checkpoint_id, deadline=time.time() + 30))
            return reply

        whole = await prepared("ck-1", "")
        assert whole.base == "" and len(whole.episodes) == 5 and whole.parked == 5
        # a_g1 passed a boundary (a new ref), a_g2 ended: the next answer names just that.
        rollouts[("a_g1", 0)].ref = EpisodeRef(rollout_id="a_g1", attempt=0, replica=0, tools=1)
        del agent.live[("a_g2", 0)]
        changed = await prepared("ck-2", "ck-1")
        assert changed.base == "ck-1" and changed.parked == 4
        assert changed.episodes == (rollouts[("a_g1", 0)].ref,)
        assert changed.gone == (AttemptRef(rollout_id="a_g2", attempt=0),)
        # A scope made against a cut this process did not answer last (it is a new process, or the
        # controller missed its answer) may leave out Runs it lacks: refused, retryable, nothing cut.
        cuts_before = agent.counts["cuts_taken"]
        with pytest.raises(ProtocolError) as refused:
            await agent.on_prepare(Prepare(checkpoint_id="ck-3", deadline=time.time() + 30, base="ck-1"))
        assert refused.value.code is ErrorCode.UNAVAILABLE and refused.value.retryable
        assert agent.counts["cuts_taken"] == cuts_before
        await agent.on_abort(Abort(checkpoint_id="ck-3", deadline=time.time() + 30))
        again = await prepared("ck-3b", "")  # the controller's next Prepare names no base: the whole cut
        assert again.base == "" and again.gone == () and len(again.episodes) == 4
        # Every rollout it held ended and new ones came: the changes (2 new, 4 gone) would be more than
        # the whole cut, which goes instead.
        agent.live.clear()
        for rollout_id in ("a_g5", "a_g6"):
            agent.latest_attempt[rollout_id] = 0
            agent.live[(rollout_id, 0)] = ParkedRollout(rollout_id, 0)  # type: ignore[assignment]
        turned_over = await prepared("ck-4", "ck-3b")
        assert turned_over.base == "" and turned_over.gone == ()
        assert {e.rollout_id for e in turned_over.episodes} == {"a_g5", "a_g6"}


@pytest.mark.asyncio
async def test_a_runs_later_prepares_and_cuts_name_only_what_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole run, in memory: each agent's Prepare names the attempts its last cut did not hold, its
    Prepared what changed in its cut since, and every whole cut still holds every attempt named (the
    capture would refuse a snapshot that lacked one): the run publishes every snapshot it takes and ends
    as a run without snapshots does."""
    seen: list[tuple[int, Prepare, Prepared]] = []
    on_prepare = Agent.on_prepare

    async def recorded(agent: Agent, command: Prepare) -> Message:
        reply = await on_prepare(agent, command)
        if isinstance(reply, Prepared):
            seen.append((agent.replica, command, reply))
        return reply

    monkeypatch.setattr(Agent, "on_prepare", recorded)
    slower = {**SNAPSHOT_RUN, "policy": {**SNAPSHOT_RUN["policy"], "per_token_delay_s": 0.003}}
    summary = await embedded_run(slower, tmp_path / "snapshotted")
    assert summary.snapshots_published >= 3 and summary.snapshots_failed == 0

    cuts: dict[int, tuple[str, cut_changes.CutRefs]] = {}
    named_fewer = changes = 0
    for replica, command, reply in seen:
        base = cuts.get(replica)
        if reply.base:  # changes against the cut the Prepare named: this agent's last one
            assert base is not None and command.base == reply.base == base[0]
            whole = cut_changes.applied(base[1], reply.episodes, reply.gone)
            changes += len(reply.episodes) < len(whole)
        else:
            whole = cut_changes.refs_of(reply.episodes)
        assert len(whole) == reply.parked
        named = {(e.rollout_id, e.attempt) for e in command.episodes}
        assert named <= whole.keys()  # every Run named had arrived, and is in the cut
        if base is not None:
            assert not named & base[1].keys()  # what its last cut held is not named again
            named_fewer += bool(whole.keys() & base[1].keys())
        cuts[replica] = (reply.checkpoint_id, whole)
    assert named_fewer, "no Prepare met an attempt its agent's cut before had held"
    assert changes, "no Prepared sent fewer refs than its whole cut"
    uncrashed = await embedded_run(slower, tmp_path / "plain", snapshots=False)
    assert summary.transcripts_sha256 == uncrashed.transcripts_sha256


async def test_an_attempts_cut_entry_is_made_as_it_passes_a_boundary_and_only_then() -> None:
    """A cut (inside the window) reads each rollout's entry as it is: the entry is made at the boundary
    (the transcript up to it, the ref with its tool calls), and between boundaries it is the same
    object, whatever the rollout has done since."""
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        agent = Agent(broker, secret=SECRET)
        run = Run(rollout_id="e_g0", attempt=0, group_id="e", env="counter", prompt="p")
        attempt = Attempt(agent, run)
        first = attempt.cut_entry
        assert first.saved.model == () and first.saved.boundaries == 0 and first.ref.tools == 0
        assert attempt.saved() is first.saved
        step = ModelStep(
            prompt_sha256="d", token_ids=(1,), logprobs=(0.0,), finish_reason="tool", staging_key="k:0"
        )
        attempt.model.append(step)
        attempt.tools.append(ToolStep(tool="add", arguments={}, ok=True, output={}))
        assert attempt.cut_entry is first  # mid-round: the cut still holds the last boundary
        await attempt._at_boundary()
        second = attempt.cut_entry
        assert second is not first and second.saved.model == (step,) and second.ref.tools == 1
        assert (second.ref.rollout_id, second.ref.attempt, second.ref.replica) == ("e_g0", 0, agent.replica)
        attempt.model.append(step)  # the next model call: the entry waits for the next boundary
        assert attempt.cut_entry is second and attempt.saved().boundaries == 1


async def test_a_continuing_attempts_cut_entry_is_its_saved_transcript_until_it_passes_it() -> None:
    """While it replays what it continues, its boundary is the end of that transcript (its tool server
    holds the sessions as they were there), made once, not at every cut."""
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        agent = Agent(broker, secret=SECRET)
        run = Run(rollout_id="e_g1", attempt=1, group_id="e", env="counter", prompt="p")
        step = ModelStep(
            prompt_sha256="d", token_ids=(1,), logprobs=(0.0,), finish_reason="tool", staging_key="k:0"
        )
        replay = SavedRollout(run=run, model=(step, step), tools=(), boundaries=2)
        attempt = Attempt(agent, run, replay)
        kept = attempt.cut_entry
        assert kept.saved == replay and kept.ref.tools == 0
        attempt.model.append(step)
        await attempt._at_boundary()  # the first replayed boundary: still short of the saved end
        assert attempt.cut_entry is not kept and attempt.cut_entry.saved == replay
        attempt.model.append(step)
        await attempt._at_boundary()  # at the saved end: its own transcript from here on
        assert attempt.cut_entry.saved.model == (step, step) and attempt.cut_entry.saved.boundaries == 2
