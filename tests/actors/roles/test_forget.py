"""Forget in the participant roles: after N rollouts sealed and forgotten, what each keeps is bounded by
what is in flight; a late duplicate of a forgotten attempt is refused; Forget waits out an open
checkpoint, is idempotent, and a restore still brings back what its snapshot holds (docs/memory.md)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from parkway.actors.roles.agent import Agent
from parkway.actors.roles.resources import Resources
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.forgetting import FORGET_FENCE_ENV, Fence, forget_fence_size
from parkway.actors.runtime.settings import SettingsError
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.errors import ErrorCode
from parkway.protocol.messages import (
    Abort,
    AttemptRef,
    Commit,
    EpisodeRef,
    Error,
    Forget,
    Ok,
    Persist,
    Prepare,
    Restore,
    Resume,
    Rows,
    Run,
    SealRows,
    StagingRow,
    ToolCall,
    ToolResult,
)

from tests.support.signed import SECRET

RUN = "unit"
ids = itertools.count()


def soon() -> float:
    return time.time() + 10


def forget(*refs: tuple[str, int]) -> Forget:
    attempts = tuple(AttemptRef(rollout_id=r, attempt=a) for r, a in refs)
    return Forget(checkpoint_id=f"fg-{next(ids)}", deadline=soon(), attempts=attempts)


def tool(rollout_id: str, tool_name: str, call_index: int, attempt: int = 0, **arguments: object) -> ToolCall:
    return ToolCall(
        rollout_id=rollout_id,
        attempt=attempt,
        call_index=call_index,
        env="bank",
        tool=tool_name,
        arguments=dict(arguments),
        seed=0,
    )


async def ask(client: Client, address: str, message: object) -> object:
    return await client.request(address, message, correlation_id=f"c-{next(ids)}")  # type: ignore[arg-type]


def test_the_fence_keeps_the_newest_ids_only() -> None:
    fence = Fence(3)
    fence.update([("r", n) for n in range(5)])
    assert list(fence) == [("r", 2), ("r", 3), ("r", 4)] and ("r", 0) not in fence
    fence.discard(("r", 3))
    assert len(fence) == 2
    with pytest.raises(ValueError):
        Fence(0)


def test_the_fence_size_setting() -> None:
    assert forget_fence_size({}) == 4096
    assert forget_fence_size({FORGET_FENCE_ENV: "12"}) == 12
    with pytest.raises(SettingsError, match=FORGET_FENCE_ENV):
        forget_fence_size({FORGET_FENCE_ENV: "0"})


async def test_resources_keep_only_what_is_live_after_many_rollouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORGET_FENCE_ENV, "16")
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(broker, secret=SECRET, snapshot_root=tmp_path)
        await actor.start()
        agent = Client(broker, secret=SECRET, sender="agent/0")
        controller = Client(broker, secret=SECRET, sender="controller/0")
        for n in range(40):  # 40 rollouts served, each verified (retired), then forgotten
            rollout = f"r{n}"
            moved = await ask(agent, "resources/0", tool(rollout, "transfer", 0, src="a", dst="b", amount=1))
            assert isinstance(moved, ToolResult) and moved.ok
            await ask(agent, "resources/0", tool(rollout, "verify", 1, calls=[]))
            assert await controller.call("resources/0", forget((rollout, 0))) == Ok(detail="forgot 1")
        await ask(agent, "resources/0", tool("live", "balance", 0, account="a"))  # one still in flight
        sizes = actor.structure_sizes()
        assert sizes["sessions"] == sizes["sessions_live"] == 1 and sizes["sessions_ended"] == 0
        assert sizes["forgotten"] == 16 and sizes["retired"] == 0  # the fence, not every rollout
        # A late duplicate of a forgotten attempt's first call: refused, no session reopened.
        late = await ask(agent, "resources/0", tool("r39", "transfer", 0, src="a", dst="b", amount=1))
        assert isinstance(late, Error) and late.code is ErrorCode.STALE_ATTEMPT and "forgotten" in late.detail
        assert set(actor.sessions) == {"live"} and actor.counts["sessions_opened"] == 41
        # Idempotent: the same Forget again changes nothing.
        assert isinstance(await controller.call("resources/0", forget(("r39", 0))), Ok)
        assert actor.structure_sizes()["forgotten"] == 16 and set(actor.sessions) == {"live"}
        # The counts still balance: every session opened was closed, but the one in flight.
        assert actor.counts["sessions_opened"] - actor.counts["sessions_retired"] == 1
        await actor.stop()


async def test_retired_sessions_never_forgotten_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORGET_FENCE_ENV, "4")
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(broker, secret=SECRET)
        await actor.start()
        agent = Client(broker, secret=SECRET, sender="agent/0")
        for n in range(10):
            await ask(agent, "resources/0", tool(f"r{n}", "verify", 0, calls=[]))
        assert set(actor.sessions) == {"r6", "r7", "r8", "r9"} and len(actor.retired) == 4
        await actor.stop()


async def test_forget_during_an_open_checkpoint_waits_for_its_end(tmp_path: Path) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(broker, secret=SECRET, snapshot_root=tmp_path)
        await actor.start()
        agent = Client(broker, secret=SECRET, sender="agent/0")
        controller = Client(broker, secret=SECRET, sender="controller/0")
        await ask(agent, "resources/0", tool("r1", "balance", 0, account="a"))
        await controller.call("resources/0", Prepare(checkpoint_id="ck-1", deadline=soon()))
        reply = await controller.call("resources/0", forget(("r1", 0)))
        assert isinstance(reply, Ok) and "when ck-1 ends" in reply.detail
        assert set(actor.sessions) == {"r1"} and actor.structure_sizes()["forget_pending"] == 1
        await controller.call("resources/0", Abort(checkpoint_id="ck-1", deadline=soon()))
        assert actor.sessions == {} and ("r1", 0) in actor.forgotten
        assert actor.structure_sizes()["forget_pending"] == 0
        await actor.stop()


async def test_a_restore_brings_back_what_the_snapshot_holds(tmp_path: Path) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(broker, secret=SECRET, snapshot_root=tmp_path)
        await actor.start()
        agent = Client(broker, secret=SECRET, sender="agent/0")
        controller = Client(broker, secret=SECRET, sender="controller/0")
        await ask(agent, "resources/0", tool("r1", "transfer", 0, src="a", dst="b", amount=10))
        await controller.call("resources/0", Prepare(checkpoint_id="c1", deadline=soon()))
        held = (EpisodeRef(rollout_id="r1", attempt=0, replica=0, tools=1),)  # its agent past the transfer
        await controller.call(
            "resources/0", Commit(checkpoint_id="c1", deadline=soon(), location="tmp_c1", episodes=held)
        )
        await controller.call("resources/0", Resume(checkpoint_id="c1", deadline=soon()))
        await controller.call("resources/0", Persist(checkpoint_id="c1", deadline=soon(), location="tmp_c1"))
        (tmp_path / RUN / "tmp_c1").rename(tmp_path / RUN / "snapshot_1")
        # After the snapshot, r1 finishes and is forgotten: nothing of it is left in memory.
        await ask(agent, "resources/0", tool("r1", "verify", 1, calls=[]))
        await controller.call("resources/0", forget(("r1", 0)))
        assert actor.sessions == {}
        scope = (EpisodeRef(rollout_id="r1", attempt=1, replica=0),)
        restore = Restore(checkpoint_id="c2", deadline=soon(), location="snapshot_1", episodes=scope)
        await controller.call("resources/0", restore)
        session = actor.sessions["r1"]
        assert session.attempt == 1 and session.revision == 1 and session.env.state["balances"]["a"] == 90
        assert not actor.forgotten  # the restored ledger may dispatch the forgotten ids again
        await actor.stop()


async def test_agents_drop_their_records_and_refuse_a_late_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORGET_FENCE_ENV, "8")
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        agent = Agent(broker, secret=SECRET)
        for n in range(30):  # records as 30 finished rollouts leave them (their tasks done)
            agent.latest_attempt[f"g_g{n}"] = 1
            agent.unacked[(f"g_g{n}", 1)] = (None, 0.0)  # type: ignore[assignment]
            agent.resends[(f"g_g{n}", 1)] = 2
        for n in range(30):
            await agent.on_forget(forget((f"g_g{n}", 0), (f"g_g{n}", 1)))
        sizes = agent.structure_sizes()
        assert (sizes["latest_attempt"], sizes["unacked"], sizes["resends"]) == (0, 0, 0)
        assert sizes["forgotten"] == 8 and sizes["attempts_running"] == 0
        await agent.on_run(Run(rollout_id="g_g29", attempt=1, group_id="g", env="counter", prompt="p"))
        assert agent.counts["runs_forgotten"] == 1 and not agent.running and not agent.latest_attempt
        # Rollouts never forgotten are bounded too: the fence size beyond those running.
        for n in range(30):
            agent._remember_latest(f"x_g{n}", 0)
        assert len(agent.latest_attempt) == 8 + 1


async def test_tq_drops_the_rows_of_forgotten_attempts_no_canonical_row_uses(tmp_path: Path) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        tq = TransferQueue(broker, secret=SECRET, snapshot_root=tmp_path)
        rows = [
            StagingRow(capture_key=key, turn=0, token_ids=(1,), logprobs=(-0.1,))
            for key in ("g_g0", "g_g0-a1")
        ]
        await tq.on_rows(Rows(rows=tuple(rows)))
        await tq.on_seal_rows(SealRows(rollout_id="g_g0", attempt=1, capture_key="g_g0-a1", reward=1.0))
        await tq.on_forget(forget(("g_g0", 0), ("g_g0", 1)))
        assert set(tq.store.staging) == {"g_g0-a1"} and set(tq.store.canonical) == {"g_g0"}
        # A late row of the forgotten attempt is refused, not stored again.
        await tq.on_rows(Rows(rows=(rows[0],)))
        assert set(tq.store.staging) == {"g_g0-a1"} and tq.counts["staging_fenced"] == 1
        sizes = tq.structure_sizes()
        assert (sizes["staging"], sizes["canonical"], sizes["staging_keys"]) == (1, 1, 1)
