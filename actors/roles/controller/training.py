"""The trainer hook: settled groups go to the trainer actor in batches, its weights to the policy, and
every few steps a trainer checkpoint with a snapshot anchored at it.

Training runs in the trainer actor (``roles/trainer.py``), not here: the controller hands it a batch
(``Train``) and goes on dispatching, sealing and snapshotting while the step runs. One batch is in
flight at a time. Handing it over is one synchronous step (the groups become ``finalizing`` and the
batch is recorded in ``RunState.training``), so a snapshot cut either predates it or holds the batch
in its anchor; a restore then sends the batch again. Applying the answer (the groups leave the
ledger, the anchor moves to the step, the policy loads the weights) is done under the snapshot lock,
so a step that ends during a snapshot waits for that snapshot instead of throwing it away.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from parkway.actors.roles.controller.fingerprints import replica_addresses
from parkway.actors.roles.controller.snapshots import SnapshotCoordinator
from parkway.actors.roles.controller.state import RunState
from parkway.actors.roles.trainer import TrainerActor
from parkway.actors.run.config import RunConfig
from parkway.actors.runtime.backoff import retrying
from parkway.actors.runtime.client import Client
from parkway.actors.sdk.trainer import Trainer
from parkway.brokers.base import Broker, BrokerError
from parkway.protocol.anchor import ControllerAnchor
from parkway.protocol.errors import ProtocolError
from parkway.protocol.ids import Role, actor_address, new_checkpoint_id
from parkway.protocol.layout import ACTOR_STATE_DIR
from parkway.protocol.ledger import Group
from parkway.protocol.messages import (
    Error,
    LoadWeights,
    ReleaseRows,
    Train,
    Trained,
    TrainerAt,
    TrainerSync,
    TrainGroup,
    WeightsLoaded,
)
from parkway.protocol.placement import by_tq_shard
from parkway.protocol.signing import Keyring
from parkway.protocol.snapshot import SnapshotFailure
from parkway.protocol.training import InTraining, train_correlation_id

log = structlog.get_logger("parkway.controller")

WEIGHTS_TIMEOUT_S = 600.0  # loading a large model's weights from disk takes minutes, not seconds
TRAINER = actor_address(Role.TRAINER, 0)
RELEASE_RETRY_S = 120.0  # how long a release of trained rows waits out a broker that is down
CHECKPOINT_RETRY_CAP_S = 30.0  # the longest pause between tries of a trainer checkpoint's files


async def inline_trainer(
    broker: Broker, keyring: Keyring, config: RunConfig, trainer: Trainer | None, snapshot_root: Path | None
) -> TrainerActor | None:
    """The trainer actor in the controller's process, started: hosting ``trainer`` when one is given
    (an embedded run, a test), the configured plugin with ``trainer.host: inline``; None when the
    trainer is a service. With snapshots its records live beside the other actors' state, under the
    state root, so that a restarted controller finds them."""
    if trainer is None and config.trainer.host == "service":
        return None
    state_dir = None
    if snapshot_root is not None:
        state_dir = snapshot_root.parent / ACTOR_STATE_DIR / broker.run / Role.TRAINER / "0"
    actor = TrainerActor(
        broker,
        keyring=keyring,  # the controller's process holds the trainer's key too when it hosts the trainer
        trainer=trainer,
        kind=config.trainer.kind,
        options=dict(config.trainer.options),
        state_dir=state_dir,
        tq_shards=config.topology.tq_shards,
    )
    await actor.start()
    return actor


class TrainingHook:
    def __init__(
        self,
        client: Client,
        state: RunState,
        counts: Counter[str],
        snapshot_lock: asyncio.Lock,
        config: RunConfig,
        task_count: int,
        snapshots: SnapshotCoordinator | None,
        wake: Callable[[], None],
    ) -> None:
        self._client, self._state, self._counts = client, state, counts
        self._snapshot_lock = snapshot_lock
        self._config, self._task_count = config, task_count
        self._snapshots = snapshots
        self._wake = wake
        # This controller process: a Train it resends is the same command; the next process's is not.
        self.session = new_checkpoint_id("tr")
        self._task: asyncio.Task[None] | None = None

    async def sync(self) -> None:
        """Before the first ``Train``: the trainer goes to the run's step (a restore's anchor, 0 on a
        fresh start) and forgets the steps after it; they are trained again from the ledger."""
        step = self._counts["train_steps"]
        reply = await self._call(
            TrainerSync(session=self.session, step=step), f"sync-{self.session}", "TrainerSync"
        )
        assert isinstance(reply, TrainerAt)
        if reply.dropped:
            self._counts["trainer_steps_dropped"] += reply.dropped
        log.info("trainer_synced", step=step, dropped=reply.dropped)

    @property
    def busy(self) -> bool:
        """A batch handed over whose answer (and checkpoint) is not done yet."""
        return self._task is not None and not self._task.done()

    def train_ready(self) -> None:
        """Hand the next batch to the trainer unless one is in flight. A batch that failed raises here
        (in the run loop): a run never ends silently."""
        if self._task is not None:
            if not self._task.done():
                return
            task, self._task = self._task, None
            task.result()
        if self._state.training is None:
            batch = self._next_batch()
            if batch is None:
                return
            for group in batch:
                self._state.ledger.finalize(group.group_id)
            # No await since the finalize: a snapshot's cut sees both or neither.
            self._state.training = InTraining(
                step=self._counts["train_steps"] + 1, groups=tuple(g.group_id for g in batch)
            )
        self._task = asyncio.get_running_loop().create_task(self._train(self._state.training))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _next_batch(self) -> list[Group] | None:
        """A full batch of settled groups, or the last, smaller one."""
        batch_size = self._config.trainer.batch_groups
        ledger = self._state.ledger
        ready = ledger.ready_groups()
        admitted = self._state.next_task >= self._task_count
        everything_settled = admitted and len(ready) == len(ledger.groups)
        if not ready or (len(ready) < batch_size and not everything_settled):
            return None
        return ready[:batch_size]

    async def _train(self, batch: InTraining) -> None:
        try:
            groups = []
            for group_id in batch.groups:
                group = self._state.ledger.groups[group_id]
                groups.append(
                    TrainGroup(
                        group_id=group_id,
                        task_index=group.task_index,
                        sealed=tuple(s.rollout_id for s in group.siblings if not s.given_up),
                        failed=tuple(s.rollout_id for s in group.siblings if s.given_up),
                    )
                )
            command = Train(session=self.session, step=batch.step, groups=tuple(groups))
            reply = await self._call(command, train_correlation_id(self.session, batch.step), "Train")
            assert isinstance(reply, Trained)
            async with self._snapshot_lock:
                await self._apply(batch, reply)
            every = self._config.trainer.checkpoint_every
            if every and self._counts["train_steps"] % every == 0:
                await self._checkpoint()
        finally:
            self._wake()

    async def _call(self, command: Train | TrainerSync, correlation_id: str, what: str) -> object:
        """Ask the trainer until it answers. The same command under the same id each time: the trainer
        answers a step it did from its record, and a step it is doing when the step ends."""
        every = self._config.trainer.resend_s
        while True:
            try:
                reply = await self._client.request(
                    TRAINER, command, correlation_id=correlation_id, timeout=every
                )
            except BrokerError:  # no answer yet: training, or a trainer process that died
                self._counts[f"trainer_resends:{what}"] += 1
                # Said each time, so that a trainer that never comes back is seen, not waited on silently.
                log.info("trainer_unanswered", command=what, correlation_id=correlation_id, after_s=every)
                continue
            if isinstance(reply, Error):
                if reply.retryable:
                    self._counts[f"trainer_resends:{what}"] += 1
                    await asyncio.sleep(min(every, 1.0))
                    continue
                raise ProtocolError(reply.code, f"trainer refused {what}: {reply.detail}")
            return reply

    async def _apply(self, batch: InTraining, step: Trained) -> None:
        ledger = self._state.ledger
        if step.weights_dir is not None:
            await self.load_weights(step.weights_dir, step.policy_version, locked=True)
        for rollout in step.rollouts:
            self._state.trained(rollout)
        self._state.policy_version = step.policy_version
        self._counts["train_steps"] += 1
        assert self._counts["train_steps"] == batch.step, (self._counts["train_steps"], batch.step)
        consumed = tuple(s.rollout_id for g in batch.groups for s in ledger.groups[g].siblings)
        for group_id in batch.groups:
            group = ledger.remove(group_id)
            self._state.trained_groups.append(group.group_id)
        self._state.prune_trained()  # with no snapshots to prune them too, they would pile up
        self._state.training = None
        log.info(
            "trained",
            step=step.step,
            groups=step.groups,
            samples=step.samples,
            mean_reward=round(step.mean_reward, 4),
            policy_version=step.policy_version,
            **({"loss": round(step.loss, 6)} if step.loss is not None else {}),
        )
        # TQ keeps rows until the trainer consumed them: after this, a snapshot no longer carries
        # them, so what a snapshot writes stays the rows of unfinished work, however long the run.
        for shard, rollouts in by_tq_shard(consumed, self._config.topology.tq_shards).items():
            await self._release(
                f"tq/{shard}", ReleaseRows(rollout_ids=rollouts), f"release:{batch.groups[0]}"
            )

    async def _release(self, address: str, command: ReleaseRows, correlation_id: str) -> None:
        """ReleaseRows until TQ answers: the step is applied already, and a broker restarting meanwhile
        (its reply lost with the connection) must not end the run. A release is idempotent: sent again,
        it changes nothing more."""
        await retrying(
            lambda: self._client.call(address, command, correlation_id=correlation_id),
            retry_on=BrokerError,
            for_s=RELEASE_RETRY_S,
            first_s=0.2,
            max_s=5.0,
            on_retry=lambda failure, pause: log.info(
                "release_retried", to=address, error=str(failure), retry_in_s=pause
            ),
        )

    async def load_weights(self, directory: str, policy_version: int, *, locked: bool = False) -> None:
        """The policy loads the step's weights before any rollout is dispatched with its version. Not
        during a snapshot: the policy's record of its weights must be the ones its rollouts used."""
        command = LoadWeights(
            checkpoint_id=new_checkpoint_id("weights"),
            deadline=time.time() + WEIGHTS_TIMEOUT_S,
            directory=directory,
            policy_version=policy_version,
        )
        replicas = replica_addresses(self._config, Role.POLICY)

        async def load_everywhere() -> None:
            # Every replica, at once: no rollout is dispatched on the version until all have it.
            replies = await asyncio.gather(*(self._client.call(a, command) for a in replicas))
            assert all(isinstance(reply, WeightsLoaded) for reply in replies), replies

        if locked:  # the caller holds the snapshot lock
            await load_everywhere()
        else:
            async with self._snapshot_lock:
                await load_everywhere()
        self._counts["weight_updates"] += 1

    async def _checkpoint(self) -> None:
        """A trainer checkpoint: the fallback marker first, then a snapshot anchored at this step. The
        trainer's own state is in its step record; the marker names the step a fallback syncs it to."""
        if self._snapshots is None:
            return
        step = self._counts["train_steps"]
        await self._write_checkpoint(
            step,
            anchor=self._state.anchor(self._counts),
            state={"policy_version": self._state.policy_version, "trainer_step": step},
        )
        try:
            async with self._snapshot_lock:
                await self._snapshots.save(force=True)
        except SnapshotFailure as failure:
            # Like a periodic one: the next interval takes a snapshot at this step (meanwhile the
            # fallback marker just written is what a restore would use).
            self._snapshots.check_failure(failure)

    async def _write_checkpoint(self, step: int, *, anchor: ControllerAnchor, state: dict[str, Any]) -> bool:
        """The fallback marker of ``step``, tried again with a doubling pause when the storage fails; the
        run goes on meanwhile and after the last try (that step has no marker: a restore falls back
        to an older one). True when written."""
        assert self._snapshots is not None
        trainer = self._config.trainer
        for tried in range(trainer.checkpoint_retries + 1):
            try:
                self._snapshots.write_trainer_checkpoint(step, anchor=anchor, state=state)
            except OSError as exc:
                self._counts["trainer_checkpoint_failures"] += 1
                detail = f"{type(exc).__name__}: {exc}"
                if tried == trainer.checkpoint_retries:
                    self._counts["trainer_checkpoints_given_up"] += 1
                    log.error("trainer_checkpoint_given_up", step=step, tries=tried + 1, detail=detail)
                    return False
                pause = min(trainer.checkpoint_retry_s * 2**tried, CHECKPOINT_RETRY_CAP_S)
                log.warning("trainer_checkpoint_failed", step=step, detail=detail, retry_in_s=pause)
                await asyncio.sleep(pause)
                continue
            self._counts["trainer_checkpoints"] += 1
            if tried:
                log.info("trainer_checkpoint_written", step=step, tries=tried + 1)
            return True
        return False
