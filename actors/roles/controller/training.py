"""The trainer hook: settled groups go to the trainer in batches, its weights to the policy, and every
few steps a trainer checkpoint with a snapshot anchored at it."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import structlog
from parkway.actors.roles.controller.snapshots import SnapshotCoordinator
from parkway.actors.roles.controller.state import RunState
from parkway.actors.run.config import RunConfig
from parkway.actors.runtime.client import Client
from parkway.actors.sdk.trainer import GroupResult, Trainer, TrainStep
from parkway.protocol.ids import new_checkpoint_id
from parkway.protocol.ledger import Group
from parkway.protocol.messages import CanonicalRows, FetchRows, LoadWeights, ReleaseRows, WeightsLoaded
from parkway.protocol.snapshot import SnapshotFailure

log = structlog.get_logger("parkway.controller")

WEIGHTS_TIMEOUT_S = 600.0  # loading a large model's weights from disk takes minutes, not seconds


class TrainingHook:
    def __init__(
        self,
        client: Client,
        state: RunState,
        counts: Counter[str],
        snapshot_lock: asyncio.Lock,
        config: RunConfig,
        trainer: Trainer,
        task_count: int,
        snapshots: SnapshotCoordinator | None,
    ) -> None:
        self._client, self._state, self._counts = client, state, counts
        self._snapshot_lock = snapshot_lock
        self._config, self.trainer, self._task_count = config, trainer, task_count
        self._snapshots = snapshots

    async def train_ready(self) -> None:
        """Every full batch of settled groups (and the last, smaller one) goes to the trainer."""
        batch_size = self._config.trainer.batch_groups
        while True:
            ledger = self._state.ledger
            ready = ledger.ready_groups()
            admitted = self._state.next_task >= self._task_count
            everything_settled = admitted and len(ready) == len(ledger.groups)
            if not ready or (len(ready) < batch_size and not everything_settled):
                return
            batch = ready[:batch_size]
            # A snapshot never sees a group between finalize and remove: no lock, and one cut while a
            # group was finalizing would restore it finalizing, where nothing ever takes it again.
            async with self._snapshot_lock:
                await self._train_batch(batch)
            every = self._config.trainer.checkpoint_every
            if every and self._counts["train_steps"] % every == 0:
                await self._checkpoint()

    async def _train_batch(self, batch: list[Group]) -> None:
        ledger = self._state.ledger
        results = []
        for group in batch:
            ledger.finalize(group.group_id)
            sealed = [s.rollout_id for s in group.siblings if not s.given_up]
            reply = await self._client.call(
                "tq/0", FetchRows(rollout_ids=tuple(sealed)), correlation_id=f"fetch:{group.group_id}"
            )
            assert isinstance(reply, CanonicalRows)
            if reply.missing:
                raise RuntimeError(f"TQ lacks canonical rows of sealed rollouts: {', '.join(reply.missing)}")
            failed = tuple(s.rollout_id for s in group.siblings if s.given_up)
            results.append(GroupResult(group.group_id, group.task_index, reply.rows, failed))
            for row in reply.rows:
                self._state.trained(row)
        step = self.trainer.train(results)
        if step.weights_dir is not None:
            await self.load_weights(step, locked=True)
        self._state.policy_version = step.policy_version
        self._counts["train_steps"] += 1
        log.info(
            "trained",
            step=step.step,
            groups=step.groups,
            samples=step.samples,
            mean_reward=round(step.mean_reward, 4),
            policy_version=step.policy_version,
        )
        for group in batch:
            ledger.remove(group.group_id)
            self._state.trained_groups.append(group.group_id)
        # TQ keeps rows until the trainer consumed them: after this, a snapshot no longer carries
        # them, so what a snapshot writes stays the rows of unfinished work, however long the run.
        consumed = tuple(s.rollout_id for group in batch for s in group.siblings)
        await self._client.call(
            "tq/0", ReleaseRows(rollout_ids=consumed), correlation_id=f"release:{batch[0].group_id}"
        )

    async def load_weights(self, step: TrainStep, *, locked: bool = False) -> None:
        """The policy loads the step's weights before any rollout is dispatched with its version. Not
        during a snapshot: the policy's record of its weights must be the ones its rollouts used."""
        assert step.weights_dir is not None
        command = LoadWeights(
            checkpoint_id=new_checkpoint_id("weights"),
            deadline=time.time() + WEIGHTS_TIMEOUT_S,
            directory=step.weights_dir,
            policy_version=step.policy_version,
        )
        if locked:  # the caller holds the snapshot lock
            reply = await self._client.call("policy/0", command)
        else:
            async with self._snapshot_lock:
                reply = await self._client.call("policy/0", command)
        assert isinstance(reply, WeightsLoaded)
        self._counts["weight_updates"] += 1

    async def _checkpoint(self) -> None:
        """A trainer checkpoint: the fallback marker first, then the trainer's state, then a snapshot
        anchored at this step. A crash anywhere in between leaves a marker that a restore can use."""
        if self._snapshots is None:
            return
        step = self._counts["train_steps"]
        self._snapshots.write_trainer_checkpoint(
            step, anchor=self._state.anchor(self._counts), state=self.trainer.state()
        )
        try:
            async with self._snapshot_lock:
                await self._snapshots.save(force=True)
        except SnapshotFailure as failure:
            # Like a periodic one: the next interval takes a snapshot at this step (meanwhile the
            # fallback marker just written is what a restore would use).
            self._snapshots.check_failure(failure)
