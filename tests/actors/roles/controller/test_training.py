"""The trainer hook with the trainer actor on the in-memory broker: training does not block the
controller, a snapshot completes while a step is in progress (the interleaving is forced with events:
the trainer plugin blocks inside ``train`` until the test releases it), and a restore of that
snapshot sends the unanswered batch again, after the trainer went back to the anchored step, so that
every group is trained exactly once.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from parkway.actors.builtin.trainers import ExampleTrainer
from parkway.actors.roles.controller.controller import Controller, RunSummary
from parkway.actors.run.config import ConfigError, RunConfig, from_dict
from parkway.actors.sdk.trainer import GroupResult, Trainer, TrainStep
from parkway.actors.storage.trainer import TrainerRecords
from parkway.protocol.anchor import decode_ledger_file
from parkway.protocol.layout import ACTOR_STATE_DIR
from parkway.protocol.ledger import GroupState

from tests.support.embedded import embedded_run, started_cluster

CONFIG = {
    "run": "trainhook",
    "seed": 5,
    "policy": {"host": "inline", "per_token_delay_s": 0.0003},
    "tasks": {"builtin": "bank", "limit": 3},
    "rollout": {"group_size": 3, "max_turns": 6},
    "trainer": {"batch_groups": 1},
    "snapshot_interval_s": 3600.0,  # only the snapshot the test asks for
}


class GatedTrainer(ExampleTrainer):
    """Each ``train`` call waits (in the trainer actor's worker thread) for one permit from the test."""

    def __init__(self) -> None:
        super().__init__()
        self.permits = threading.Semaphore(0)
        self.calls = 0
        self.called = [threading.Event() for _ in range(8)]  # called[n]: the (n+1)th call began

    def train(self, batch: list[GroupResult]) -> TrainStep:
        self.called[min(self.calls, 7)].set()
        self.calls += 1
        assert self.permits.acquire(timeout=120), "the test never let this step finish"
        return super().train(batch)

    def open(self) -> None:
        for _ in range(16):
            self.permits.release()


async def until_called(trainer: GatedTrainer, n: int) -> None:
    """The ``n``th ``train`` call has begun (waited for in a thread: the plugin's own event)."""
    assert await asyncio.to_thread(trainer.called[n - 1].wait, 120), f"train call {n} never began"


async def run_on(
    config: RunConfig, state: Path, trainer: Trainer
) -> tuple[Controller, asyncio.Task[RunSummary]]:
    controller, _, workload = await started_cluster(config, state, trainer)
    return controller, workload


async def wound_up(trainer: GatedTrainer, workload: asyncio.Task[RunSummary]) -> None:
    """However the test ended: the trainer let go and the workload finished or cancelled."""
    trainer.open()
    if not workload.done():
        workload.cancel()
    await asyncio.gather(workload, return_exceptions=True)


def trainer_steps(state: Path) -> list[tuple[int, tuple[str, ...]]]:
    records = TrainerRecords(state / ACTOR_STATE_DIR / CONFIG["run"] / "trainer" / "0" / "steps")
    return [(r.step, r.groups) for r in records.steps()]


async def test_a_snapshot_completes_while_a_step_trains_and_its_restore_trains_the_batch_once(
    tmp_path: Path,
) -> None:
    reference = await embedded_run(CONFIG, tmp_path / "reference", snapshots=False)
    config = from_dict(CONFIG)
    state = tmp_path / "state"
    gated = GatedTrainer()
    controller, workload = await run_on(config, state, gated)
    try:
        await until_called(gated, 1)  # step 1 is training, and stays so until a permit
        assert controller.counts["train_steps"] == 0 and controller.state.training is not None
        published = await controller.take_snapshot()
        assert published is not None, "the snapshot did not complete while the step was in progress"
        assert gated.calls == 1 and controller.counts["train_steps"] == 0  # still training
        saved = decode_ledger_file((published.path / "ledger.msgpack").read_bytes()).controller
        manifest = json.loads((published.path / "manifest.json").read_text())
        assert saved.train_steps == 0 and manifest["trainer"]["step"] == 0
        assert saved.training is not None and saved.training.step == 1
        in_flight = saved.training.groups
        assert len(in_flight) == 1
        # Step 1 finishes after the cut; the controller hands over step 2, and the cluster dies.
        gated.permits.release()
        await until_called(gated, 2)
        assert trainer_steps(state)[:1] == [(1, in_flight)]  # the dead cluster's trainer did step 1
    finally:
        workload.cancel()
        gated.open()  # the worker thread of a step in progress ends; its answer goes nowhere
        await asyncio.gather(workload, return_exceptions=True)

    again, resumed = await run_on(config, state, ExampleTrainer())
    summary = await resumed
    assert summary.restores == 1 and again.counts["trainer_steps_dropped"] >= 1  # step 1 forgotten
    # Every group trained exactly once, in contiguous steps; the in-flight batch was step 1 again.
    steps = trainer_steps(state)
    assert [s for s, _ in steps] == [1, 2, 3] and steps[0][1] == in_flight
    groups = [g for _, gs in steps for g in gs]
    assert sorted(groups) == sorted(set(groups)) and len(groups) == 3
    assert summary.rollouts_sealed == summary.rollouts_expected == 9 and summary.rollouts_failed == 0
    assert summary.transcripts_sha256 == reference.transcripts_sha256  # each rollout counted once


async def test_training_does_not_block_the_controller(tmp_path: Path) -> None:
    """While step 1 trains (held), the controller keeps dispatching and sealing the other groups: one
    group in flight at a time, so groups 2 and 3 are dispatched after group 1 went to the trainer."""
    rollout = {**CONFIG["rollout"], "max_in_flight": 3}
    config = from_dict({**CONFIG, "rollout": rollout, "snapshot_interval_s": 0.05})
    gated = GatedTrainer()
    controller, workload = await run_on(config, tmp_path, gated)
    try:
        await until_called(gated, 1)
        # Held at step 1: the remaining rollouts still seal and snapshots still publish.
        while controller.counts["rollouts_sealed"] < 9:  # noqa: ASYNC110 - another task's counters
            await asyncio.sleep(0.01)
        assert gated.calls == 1 and controller.counts["train_steps"] == 0
        gated.open()
        summary = await workload
    finally:
        await wound_up(gated, workload)
    assert summary.rollouts_sealed == 9 and summary.snapshots_published >= 1
    assert [s for s, _ in trainer_steps(tmp_path)] == [1, 2, 3]


async def test_a_trainer_behind_holds_admission_at_the_bound_of_untrained_groups(tmp_path: Path) -> None:
    """Backpressure: with step 1 held, admission stops once ``trainer.max_untrained_groups`` (2) groups
    are sealed and not trained; a group admitted before the second one sealed (one group in flight at
    a time: admitted when the last rollout of the one before completes, which can be just before or
    just after its seal) still finishes, and none after it is admitted, however long the trainer takes.
    Released, the run admits again and trains every group once."""
    rollout = {**CONFIG["rollout"], "max_in_flight": 3}
    data = {
        **CONFIG,
        "tasks": {"builtin": "bank", "limit": 4},
        "rollout": rollout,
        "trainer": {"batch_groups": 1, "max_untrained_groups": 2},
        "snapshot_interval_s": 0.05,
    }
    config = from_dict(data)
    gated = GatedTrainer()
    controller, workload = await run_on(config, tmp_path, gated)

    def held_and_settled() -> bool:
        ledger = controller.state.ledger  # the run's (a run starts with a ledger of its own)
        return (
            controller.counts["admission_waits_for_trainer"] >= 1
            and ledger.in_flight() == 0
            and all(g.state is not GroupState.GENERATING for g in ledger.groups.values())
        )

    try:
        await until_called(gated, 1)
        while not held_and_settled():  # noqa: ASYNC110 - another task's counters
            await asyncio.sleep(0.01)
        admitted, ledger = controller.state.next_task, controller.state.ledger
        assert admitted in (2, 3) and len(ledger.groups) == admitted  # none trained yet
        for _ in range(5):  # the run loop woken again and again: admission stays held
            controller._wake.set()
            await asyncio.sleep(0.02)
        assert controller.counts["admission_waits_for_trainer"] == 1
        assert controller.state.next_task == admitted and len(ledger.groups) == admitted
        assert controller.counts["rollouts_sealed"] == 3 * admitted and gated.calls == 1
        gated.open()
        summary = await workload
    finally:
        await wound_up(gated, workload)
    assert summary.rollouts_sealed == 12
    assert [s for s, _ in trainer_steps(tmp_path)] == [1, 2, 3, 4]


def test_a_bound_below_one_batch_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"trainer\.max_untrained_groups: 1 is fewer than trainer\.batch_groups"
    ):
        from_dict({"trainer": {"batch_groups": 2, "max_untrained_groups": 1}})
