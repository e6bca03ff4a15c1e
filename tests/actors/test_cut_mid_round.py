"""A tool call in flight does not hold a snapshot's cut (docs/snapshots.md#the-cut).

Each turn of ``TwoIncrements`` makes two mutating calls. The test holds the second call of one
rollout's second turn at its tool server, with the first call of that round already applied, and asks
for a snapshot meanwhile: the agent cuts the rollout at its last boundary (before the round) without
waiting, and the tool server saves the session as it was there, from the copy it kept before the
round's first mutation. The cluster is then thrown away mid-call and a fresh one restores the snapshot:
the round is redone from its boundary, each increment applied once, and the transcripts are those of
a run that never crashed. With round copies switched off, the same snapshot waits for the held call
and fails at its deadline: the mechanism, not luck, is what lets it through.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.builtin.environments import Counter
from parkway.actors.launch.workload import run_workload
from parkway.actors.roles.controller.controller import RunSummary
from parkway.actors.roles.resources import Resources
from parkway.actors.run.config import from_dict
from parkway.actors.run.tasks import load_tasks
from parkway.actors.runtime.client import Client
from parkway.actors.sdk import chat
from parkway.actors.sdk.rollout import AgentProgram, RolloutContext, RolloutFailure
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Commit, Error, Message, Snapshot, SnapshotTaken, ToolCall

from tests.support.signed import SECRET

HELD = ("t0000_g0", 3)  # the rollout, and its fourth tool call: the second of its second round


class TwoIncrements(AgentProgram):
    """Each turn: one model call, then two increments in one tool round."""

    name = "two-increments"

    async def run(self, ctx: RolloutContext) -> float:
        messages = [chat.Message("system", chat.system_prompt(ctx.prompt, list(ctx.tools), ctx.max_turns))]
        for turn in range(ctx.max_turns):
            reply = await ctx.generate(messages)
            messages.append(chat.Message("assistant", reply.text))
            for by in (len(reply.token_ids) % 5 + 1, 2):
                outcome = await ctx.call_tool("increment", {"by": by})
                if not outcome.ok:
                    raise RolloutFailure("tool_error", f"turn {turn}: {outcome.output}")
                messages.append(chat.Message("tool", json.dumps(outcome.output)))
            await ctx.end_tool_round()
        return await ctx.verify()


def config(**overrides: Any) -> dict[str, Any]:
    return {
        "run": "midround",
        "seed": 5,
        "agent": f"{__name__}:TwoIncrements",
        "environments": ["counter"],
        "policy": {"host": "inline", "per_token_delay_s": 0.0002},
        "tasks": {"builtin": "counter", "limit": 1},
        "rollout": {"group_size": 2, "max_turns": 4},
        "snapshot_interval_s": 3600.0,  # only the snapshot the test asks for
        **overrides,
    }


async def uncrashed(state: Path) -> RunSummary:
    return await uncrashed_of(config(), state)


async def uncrashed_of(data: dict[str, Any], state: Path) -> RunSummary:
    cfg = from_dict(data)
    async with MemoryBroker(MemoryHub(), cfg.run) as broker:
        return await run_workload(
            broker, SECRET, cfg, load_tasks(cfg.tasks), embedded=True, state_root=state, snapshots=False
        )


async def restored_as_uncrashed(data: dict[str, Any], state: Path, reference: RunSummary) -> None:
    """A fresh cluster restores the snapshot in ``state`` and ends as the uncrashed run did: every
    rollout sealed, no tool mutation applied twice, the same transcripts."""
    cfg = from_dict(data)
    async with MemoryBroker(MemoryHub(), cfg.run) as broker:
        resumed = await run_workload(
            broker, SECRET, cfg, load_tasks(cfg.tasks), embedded=True, state_root=state
        )
    assert resumed.restores == 1 and resumed.rollouts_restored >= 1
    assert resumed.rollouts_sealed == resumed.rollouts_expected == 2 and resumed.rollouts_failed == 0
    assert resumed.tool_mutations_duplicated == 0 and resumed.mean_reward == 1.0
    assert resumed.transcripts_sha256 == reference.transcripts_sha256


async def snapshot_while_a_call_is_held(
    state: Path, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> tuple[Message | None, dict[str, Any]]:
    """Run until HELD reaches its tool server (the round's first increment applied), ask for a snapshot,
    then drop the whole cluster with the call still held. The snapshot's answer, and what the tool
    server held of that session when the call arrived."""
    reached, never = asyncio.Event(), asyncio.Event()
    seen: dict[str, Any] = {}
    original = Resources.on_tool_call

    async def holding(self: Resources, call: ToolCall) -> Message:
        if (call.rollout_id, call.call_index) == HELD and call.attempt == 0:
            session = self.sessions[call.rollout_id]
            seen.update(applied=sorted(session.applied), boundary_tools=call.boundary_tools)
            reached.set()
            await never.wait()  # held for good: the cluster goes away with it
        return await original(self, call)

    monkeypatch.setattr(Resources, "on_tool_call", holding)
    cfg = from_dict(config(**overrides))
    reply: Message | None = None
    async with MemoryBroker(MemoryHub(), cfg.run) as broker:
        workload = asyncio.ensure_future(
            run_workload(broker, SECRET, cfg, load_tasks(cfg.tasks), embedded=True, state_root=state)
        )
        done, _ = await asyncio.wait(
            {workload, asyncio.ensure_future(reached.wait())}, timeout=60, return_when=asyncio.FIRST_COMPLETED
        )
        assert reached.is_set(), (
            f"the held call was never made: {[t.result() for t in done if t is workload]}"
        )
        client = Client(broker, secret=SECRET, sender="cli/1")
        reply = await client.request(
            "controller/0", Snapshot(checkpoint_id="mid-round", deadline=time.time() + 30), timeout=30
        )
        workload.cancel()  # the crash: every actor and its memory gone, the call never answered
        never.set()  # (a stopping tool server waits for the handlers it runs; this cluster is gone)
        await asyncio.gather(workload, return_exceptions=True)
    monkeypatch.setattr(Resources, "on_tool_call", original)
    return reply, seen


async def test_a_tool_call_in_flight_does_not_hold_the_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = await uncrashed(tmp_path / "reference")
    state = tmp_path / "state"
    reply, seen = await snapshot_while_a_call_is_held(state, monkeypatch)
    # The held call is the second of its round: the first one (index 2) was applied before it came.
    assert seen == {"applied": [0, 1, 2], "boundary_tools": 2}
    assert isinstance(reply, SnapshotTaken) and reply.snapshot == "snapshot_1", reply

    manifest = json.loads((state / "snapshots" / "midround" / "snapshot_1" / "manifest.json").read_text())
    assert ["t0000_g0", 0] in manifest["episodes"], "the held rollout is in the cut, mid-round"

    # The round redone from its boundary on the session as it was there: each increment once.
    await restored_as_uncrashed(config(), state, reference)


async def test_without_round_copies_the_cut_waits_for_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Counter, "round_copies", False)
    reply, seen = await snapshot_while_a_call_is_held(tmp_path, monkeypatch, prepare_timeout_s=1.0)
    assert seen["applied"] == [0, 1, 2]
    assert isinstance(reply, Error) and "prepare" in reply.detail, reply


async def test_a_rollout_runs_on_for_rounds_before_its_tool_server_cuts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent lets a rollout go once it cut it; its tool server cuts later (after the window). Here
    # the tool servers' Commit is held until a rollout has made two more rounds of calls: the session
    # is cut at the agent's boundary from the copy kept before those rounds, and a crash redoes them.
    state = tmp_path / "state"
    original, answered = Resources.on_commit, Resources._answered
    marks: dict[str, int] = {}
    applied = asyncio.Event()  # set at every call a tool server answers

    def answering(self: Resources, *args: Any) -> Any:
        applied.set()
        return answered(self, *args)

    async def late_commit(self: Resources, command: Commit) -> Message:
        for episode in command.episodes:
            session = self.sessions.get(episode.rollout_id)
            if session is not None and not session.retired and episode.tools > 0:
                while len(session.applied) < episode.tools + 4 and not session.retired:
                    applied.clear()
                    await applied.wait()  # two more rounds, each two increments
                marks[episode.rollout_id] = episode.tools
        return await original(self, command)

    monkeypatch.setattr(Resources, "_answered", answering)
    monkeypatch.setattr(Resources, "on_commit", late_commit)
    cfg = from_dict(config(rollout={"group_size": 2, "max_turns": 8}, snapshot_interval_s=3600.0))
    async with MemoryBroker(MemoryHub(), cfg.run) as broker:
        workload = asyncio.ensure_future(
            run_workload(broker, SECRET, cfg, load_tasks(cfg.tasks), embedded=True, state_root=state)
        )
        client = Client(broker, secret=SECRET, sender="cli/1")
        reply: Message | None = None
        for _ in range(400):  # once both rollouts have made a round or two
            await asyncio.sleep(0.01)
            reply = await client.request(
                "controller/0", Snapshot(checkpoint_id=f"late-{_}", deadline=time.time() + 30), timeout=30
            )
            if isinstance(reply, SnapshotTaken) and marks:
                break
        workload.cancel()
        await asyncio.gather(workload, return_exceptions=True)
    monkeypatch.setattr(Resources, "on_commit", original)
    monkeypatch.setattr(Resources, "_answered", answered)
    assert isinstance(reply, SnapshotTaken) and marks, "no session was cut after rounds went on"

    data = config(rollout={"group_size": 2, "max_turns": 8})
    reference = await uncrashed_of(data, tmp_path / "reference8")
    await restored_as_uncrashed(data, state, reference)
