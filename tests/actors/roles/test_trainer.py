"""The trainer actor on the in-memory broker, with a fake ``tq/0`` that serves canonical rows.

Exactly once per batch: a ``Train`` is trained once and a repeat of it (a resend, a redelivery, the
same step from a restarted controller session is refused) is answered from the step record; a
trainer started again on the same state directory continues from its last record; ``TrainerSync``
takes it back to an anchored step, and the steps after it are trained again, once each.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.builtin.trainers import ExampleTrainer
from parkway.actors.roles.trainer import TrainerActor
from parkway.actors.runtime.actor import Actor
from parkway.actors.runtime.client import Client
from parkway.actors.sdk.trainer import GroupResult, TrainStep
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.errors import ErrorCode
from parkway.protocol.messages import (
    CanonicalRow,
    CanonicalRows,
    Error,
    FetchRows,
    Message,
    StagingRow,
    Status,
    StatusReport,
    Train,
    Trained,
    TrainerAt,
    TrainerSync,
    TrainGroup,
)
from parkway.protocol.training import train_correlation_id

from tests.support.signed import SECRET

RUN = "trainer-unit"


class FakeTQ(Actor):
    """``tq/0``: a canonical row for every rollout asked for (one turn, its tokens from its name)."""

    role = "tq"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handlers[FetchRows] = self.on_fetch

    async def on_fetch(self, fetch: FetchRows) -> Message:
        rows = tuple(
            CanonicalRow(
                rollout_id=r,
                attempt=0,
                capture_key=r,
                reward=1.0,
                turns=(StagingRow(capture_key=r, turn=0, token_ids=(len(r), 2)),),
            )
            for r in fetch.rollout_ids
            if "gone" not in r
        )
        return CanonicalRows(rows=rows, missing=tuple(r for r in fetch.rollout_ids if "gone" in r))


class CountingTrainer(ExampleTrainer):
    """The example trainer, counting the batches it was given (in the worker thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, ...]] = []

    def train(self, batch: list[GroupResult]) -> TrainStep:
        self.batches.append(tuple(g.group_id for g in batch))
        return super().train(batch)


def train(session: str, step: int, *groups: str) -> Train:
    return Train(
        session=session,
        step=step,
        groups=tuple(
            TrainGroup(group_id=g, task_index=i, sealed=(f"{g}_g0", f"{g}_g1")) for i, g in enumerate(groups)
        ),
    )


async def ask(client: Client, message: Train | TrainerSync, correlation_id: str) -> Message:
    return await client.request("trainer/0", message, correlation_id=correlation_id, timeout=30)


@pytest.fixture
async def broker() -> Any:
    async with MemoryBroker(MemoryHub(), RUN) as b:
        tq = FakeTQ(b, secret=SECRET)
        await tq.start()
        yield b
        await tq.stop()


async def start(broker: MemoryBroker, plugin: CountingTrainer, state: Path | None) -> TrainerActor:
    actor = TrainerActor(broker, secret=SECRET, trainer=plugin, state_dir=state)
    await actor.start()
    return actor


async def test_train_is_answered_once_and_repeated_from_the_record(
    broker: MemoryBroker, tmp_path: Path
) -> None:
    plugin = CountingTrainer()
    actor = await start(broker, plugin, tmp_path / "trainer")
    client = Client(broker, secret=SECRET, sender="controller/0")
    try:
        at = await ask(client, TrainerSync(session="s1", step=0), "sync-s1")
        assert isinstance(at, TrainerAt) and (at.step, at.dropped) == (0, 0)
        first = await ask(client, train("s1", 1, "t0", "t1"), train_correlation_id("s1", 1))
        assert isinstance(first, Trained) and (first.step, first.policy_version, first.samples) == (1, 1, 4)
        assert {r.rollout_id for r in first.rollouts} == {"t0_g0", "t0_g1", "t1_g0", "t1_g1"}
        # The same command again (a resend), and under a fresh id (a redelivery the reply cache missed):
        # both answered from the step record, the plugin trained the batch once.
        again = await ask(client, train("s1", 1, "t0", "t1"), train_correlation_id("s1", 1))
        fresh = await ask(client, train("s1", 1, "t0", "t1"), "another-id")
        assert again == first == fresh
        assert plugin.batches == [("t0", "t1")] and actor.counts["train_replayed"] == 1
        # Step 1 again with other groups: a conflict, not a second training.
        conflict = await ask(client, train("s1", 1, "t2"), "conflict")
        assert isinstance(conflict, Error) and conflict.code == ErrorCode.CHECKPOINT_CONFLICT
        # A gap: steps are trained in order.
        gap = await ask(client, train("s1", 3, "t2"), train_correlation_id("s1", 3))
        assert isinstance(gap, Error) and gap.code == ErrorCode.INVALID_PHASE
        # A controller session the trainer was not synced with is refused (the dead cluster's Train).
        stale = await ask(client, train("s0", 2, "t2"), train_correlation_id("s0", 2))
        assert isinstance(stale, Error) and stale.code == ErrorCode.STALE_CHECKPOINT
        assert plugin.batches == [("t0", "t1")]
        second = await ask(client, train("s1", 2, "t2"), train_correlation_id("s1", 2))
        assert isinstance(second, Trained) and (second.step, second.policy_version) == (2, 2)
        assert [(r.step, r.groups) for r in actor.records.steps()] == [(1, ("t0", "t1")), (2, ("t2",))]
    finally:
        await actor.stop()


async def test_a_restarted_trainer_resumes_from_its_checkpoint(broker: MemoryBroker, tmp_path: Path) -> None:
    state = tmp_path / "trainer"
    client = Client(broker, secret=SECRET, sender="controller/0")
    first = await start(broker, CountingTrainer(), state)
    try:
        await ask(client, TrainerSync(session="s1", step=0), "sync-s1")
        one = await ask(client, train("s1", 1, "t0"), train_correlation_id("s1", 1))
        two = await ask(client, train("s1", 2, "t1"), train_correlation_id("s1", 2))
        assert isinstance(one, Trained) and isinstance(two, Trained)
    finally:
        await first.stop()  # everything in memory is gone; the state directory stays

    plugin = CountingTrainer()
    second = await start(broker, plugin, state)
    try:
        assert plugin.policy_version == 2  # the plugin's state of the last recorded step
        # The controller resends its unanswered Train (same session, same step): from the record.
        repeated = await ask(client, train("s1", 2, "t1"), train_correlation_id("s1", 2))
        assert repeated == two and plugin.batches == []
        three = await ask(client, train("s1", 3, "t2"), train_correlation_id("s1", 3))
        assert isinstance(three, Trained) and (three.step, three.policy_version) == (3, 3)
        assert plugin.batches == [("t2",)]
        # A restore anchored at step 1: back there, steps 2 and 3 forgotten and trained again, once.
        at = await ask(client, TrainerSync(session="s2", step=1), "sync-s2")
        assert isinstance(at, TrainerAt) and (at.step, at.policy_version, at.dropped) == (1, 1, 2)
        assert plugin.policy_version == 1
        redo = await ask(client, train("s2", 2, "t1"), train_correlation_id("s2", 2))
        assert isinstance(redo, Trained) and (redo.step, redo.policy_version) == (2, 2)
        assert [(r.step, r.groups, r.session) for r in second.records.steps()] == [
            (1, ("t0",), "s1"),
            (2, ("t1",), "s2"),
        ]
        # Asked to go past its records (a state directory that is not the run's): refused, named.
        ahead = await ask(client, TrainerSync(session="s3", step=5), "sync-s3")
        assert isinstance(ahead, Error) and ahead.code == ErrorCode.INVALID_PHASE and "step 2" in ahead.detail
    finally:
        await second.stop()


class GatedTrainer(CountingTrainer):
    """Blocks inside ``train`` until released: a step in progress, for as long as the test wants."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()

    def train(self, batch: list[GroupResult]) -> TrainStep:
        self.started.set()
        assert self.release.wait(60), "the test never released the step"
        return super().train(batch)


async def test_the_trainer_answers_while_a_step_runs_and_a_duplicate_waits_for_it(
    broker: MemoryBroker,
) -> None:
    plugin = GatedTrainer()
    actor = await start(broker, plugin, None)
    client = Client(broker, secret=SECRET, sender="controller/0")
    try:
        await ask(client, TrainerSync(session="s1", step=0), "sync-s1")
        cid = train_correlation_id("s1", 1)
        running = asyncio.ensure_future(ask(client, train("s1", 1, "t0"), cid))
        assert await asyncio.to_thread(plugin.started.wait, 30)
        # The step runs in a thread: the actor's loop answers Status, and a resend waits for the step.
        status = await client.request("trainer/0", Status(checkpoint_id="st-1", deadline=time.time() + 10))
        assert isinstance(status, StatusReport) and status.role == "trainer"
        duplicate = asyncio.ensure_future(ask(client, train("s1", 1, "t0"), cid))
        assert not running.done() and not duplicate.done()
        plugin.release.set()
        first, second = await running, await duplicate
        assert isinstance(first, Trained) and first == second and plugin.batches == [("t0",)]
    finally:
        plugin.release.set()
        await actor.stop()


class FailingTrainer(CountingTrainer):
    """Fails its second step half-way, after changing its state."""

    def train(self, batch: list[GroupResult]) -> TrainStep:
        if self.batches:
            self.policy_version += 100  # a half-done update
            self.batches.append(("failed",))
            raise RuntimeError("out of GPU memory")
        return super().train(batch)


async def test_bad_input_and_a_failing_plugin_get_typed_errors_and_the_trainer_serves_on(
    broker: MemoryBroker,
) -> None:
    plugin = FailingTrainer()
    actor = await start(broker, plugin, None)
    client = Client(broker, secret=SECRET, sender="controller/0")
    try:
        await ask(client, TrainerSync(session="s1", step=0), "sync-s1")
        # Rows TQ does not have: retryable (the controller sends the step again), nothing trained.
        missing = await ask(client, train("s1", 1, "gone"), train_correlation_id("s1", 1))
        assert isinstance(missing, Error) and missing.code == ErrorCode.UNAVAILABLE and missing.retryable
        assert "gone_g0" in missing.detail and plugin.batches == []
        one = await ask(client, train("s1", 1, "t0"), train_correlation_id("s1", 1))
        assert isinstance(one, Trained) and one.policy_version == 1
        # The plugin raises: an internal error, and its state goes back to step 1's.
        failed = await ask(client, train("s1", 2, "t1"), train_correlation_id("s1", 2))
        assert isinstance(failed, Error) and failed.code == ErrorCode.INTERNAL
        assert "out of GPU memory" in failed.detail and plugin.policy_version == 1
        assert actor.records.last_step == 1
        # A sync past the records is refused by name; the actor still answers.
        ahead = await ask(client, TrainerSync(session="s2", step=4), "sync-s2")
        assert isinstance(ahead, Error) and ahead.code == ErrorCode.INVALID_PHASE
        status = await client.request("trainer/0", Status(checkpoint_id="st-2", deadline=time.time() + 10))
        assert isinstance(status, StatusReport) and status.counts["train_step"] == 1
    finally:
        await actor.stop()
