"""The trainer actor: hosts the run's trainer plugin (``sdk.trainer.Trainer``) and trains each batch of
settled groups exactly once, however often the controller asks and however often this process dies.

A ``Train`` names a step. The trainer reads the groups' canonical rows from TQ, runs the plugin's
``train`` in a worker thread (its event loop keeps answering ``Status`` and duplicates meanwhile),
writes the step's record durably (the plugin's state after the step, the groups, the reply) and only
then answers. A repeated ``Train`` of a recorded step is answered from the record, never trained
again; a trainer SIGKILLed mid-step restarts from its last record and trains that step when the
controller sends it again. ``TrainerSync`` (the first thing a controller sends) takes the trainer
back to the run's anchored step, dropping the records after it, and fences every older controller
session: after a restore, the steps after the anchor are trained again, once.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import msgspec
import structlog
from parkway.actors.runtime.actor import Actor
from parkway.actors.sdk import plugins
from parkway.actors.sdk.trainer import GroupResult, Trainer, TrainStep
from parkway.actors.storage.trainer import TrainerRecords
from parkway.protocol import layout
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.ids import Role
from parkway.protocol.messages import (
    CanonicalRow,
    CanonicalRows,
    FetchRows,
    Message,
    Train,
    Trained,
    TrainedRollout,
    TrainerAt,
    TrainerSync,
)
from parkway.protocol.placement import by_tq_shard
from parkway.protocol.training import StepRecord, transcript_digest

log = structlog.get_logger("parkway.trainer")
REPLY_CAPACITY = 64  # replies kept: a retry of a recent step is answered from its record anyway

FETCH_TIMEOUT_S = 60.0  # canonical rows of a whole batch, possibly large


def row_digest(row: CanonicalRow) -> str:
    """``transcript_digest`` of a row, as the hex ``TrainedRollout.digest`` carries."""
    return f"{transcript_digest(row.rollout_id, [(t.turn, tuple(t.token_ids)) for t in row.turns]):064x}"


class TrainerActor(Actor):
    role = Role.TRAINER
    prefetch = 16  # a step runs in a thread; Status and duplicates of it are answered meanwhile

    def __init__(
        self,
        *args: Any,
        trainer: Trainer | None = None,
        kind: str = "example",
        options: dict[str, Any] | None = None,
        records_dir: Path | None = None,
        tq_shards: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # A retried Train is answered from the step records, never from the reply cache: a few
        # replies suffice there, not 4,096 of about 2 KB each (the soak's driver grew by them).
        self.replies.capacity = min(self.replies.capacity, REPLY_CAPACITY)
        if trainer is None:
            trainer = plugins.check_trainer(plugins.resolve(plugins.Kind.TRAINER, kind), dict(options or {}))
        self.trainer = trainer
        self.tq_shards = tq_shards  # a rollout's rows are on its shard (``placement.tq_of``)
        self._initial = trainer.state()  # step 0: what a sync back to the start loads
        if records_dir is None and self.state_dir is not None:
            records_dir = self.state_dir / layout.TRAINER_STEPS_DIR
        self.records = TrainerRecords(records_dir)
        last = self.records.get(self.records.last_step)
        if last is not None:  # a restarted trainer continues from its last recorded step
            self.trainer.load_state(last.state)
            log.info("trainer_resumed", step=last.step)
        self._steps = asyncio.Lock()  # one step (or sync) at a time, in step order
        self.handlers.update({Train: self.on_train, TrainerSync: self.on_sync})

    @property
    def step(self) -> int:
        return self.records.last_step

    def structure_sizes(self) -> dict[str, int]:
        """The step records held in memory: at most ``TrainerRecords.keep`` (docs/memory.md)."""
        return {**super().structure_sizes(), "step_records": self.records.in_memory()}

    async def on_sync(self, command: TrainerSync) -> Message:
        async with self._steps:
            last = self.records.last_step
            if command.step > last or (command.step and self.records.get(command.step) is None):
                raise ProtocolError(
                    ErrorCode.INVALID_PHASE,
                    f"asked to go to step {command.step}, but this trainer's records end at step {last}: "
                    "its state directory is not the one the run's snapshots were anchored with",
                )
            self.records.set_fence(command.session)
            dropped = self.records.drop_after(command.step)
            record = self.records.get(command.step)
            self.trainer.load_state(record.state if record is not None else self._initial)
            version = _decode_reply(record).policy_version if record is not None else 0
            log.info("trainer_synced", step=command.step, dropped=dropped, session=command.session)
            return TrainerAt(step=command.step, policy_version=version, dropped=dropped)

    async def on_train(self, command: Train) -> Message:
        async with self._steps:
            if self.records.fence and command.session != self.records.fence:
                raise ProtocolError(
                    ErrorCode.STALE_CHECKPOINT,
                    f"Train of session {command.session} after session {self.records.fence} synced",
                )
            groups = tuple(g.group_id for g in command.groups)
            record = self.records.get(command.step)
            if record is not None:
                if record.groups != groups:
                    raise ProtocolError(
                        ErrorCode.CHECKPOINT_CONFLICT,
                        f"step {command.step} was trained on {', '.join(record.groups)}, not on "
                        f"{', '.join(groups)}",
                    )
                self.counts["train_replayed"] += 1
                log.info("train_replayed", step=command.step)
                return _decode_reply(record)
            if command.step != self.records.last_step + 1:
                raise ProtocolError(
                    ErrorCode.INVALID_PHASE,
                    f"step {command.step} asked for after step {self.records.last_step}: steps are trained "
                    "in order",
                )
            batch = await self._fetch(command)
            before = self.records.get(self.records.last_step)
            try:
                done = await asyncio.to_thread(self.trainer.train, batch)
            except Exception:
                # The plugin may have changed its state half-way: back to the last recorded step.
                self.trainer.load_state(before.state if before is not None else self._initial)
                raise
            reply = _reply(command.step, done, batch)
            self.faults.reach("trainer_before_record")
            self.records.write(
                StepRecord(
                    step=command.step,
                    session=command.session,
                    groups=groups,
                    state=self.trainer.state(),
                    reply=msgspec.msgpack.encode(reply),
                )
            )
            self.faults.reach("trainer_after_record")
            self.counts["train_step"] = command.step  # Status shows how far the trainer got
            log.info("step_trained", step=command.step, groups=len(groups), samples=reply.samples)
            return reply

    async def _fetch(self, command: Train) -> list[GroupResult]:
        sealed = tuple(r for g in command.groups for r in g.sealed)
        rows: dict[str, CanonicalRow] = {}
        for shard, rollout_ids in by_tq_shard(sealed, self.tq_shards).items():  # each from its shard
            reply = await self.client.call(
                f"tq/{shard}",
                FetchRows(rollout_ids=rollout_ids),
                # A read: a fresh id each time, or TQ's reply cache would answer a retry with old rows.
                correlation_id=f"fetch-{command.session}-s{command.step}-{secrets.token_hex(4)}",
                timeout=FETCH_TIMEOUT_S,
            )
            if not isinstance(reply, CanonicalRows):
                raise ProtocolError(ErrorCode.INTERNAL, f"TQ answered FetchRows with {type(reply).__name__}")
            if reply.missing:  # retryable: the controller sends the step again
                raise ProtocolError(
                    ErrorCode.UNAVAILABLE,
                    f"tq/{shard} lacks canonical rows of sealed rollouts: {', '.join(reply.missing)}",
                )
            rows.update((row.rollout_id, row) for row in reply.rows)
        return [
            GroupResult(g.group_id, g.task_index, tuple(rows[r] for r in g.sealed), g.failed)
            for g in command.groups
        ]


def _reply(step: int, done: TrainStep, batch: list[GroupResult]) -> Trained:
    return Trained(
        step=step,
        policy_version=done.policy_version,
        groups=done.groups,
        samples=done.samples,
        failed=done.failed,
        mean_reward=done.mean_reward,
        tokens=done.tokens,
        weights_dir=done.weights_dir,
        loss=done.loss,
        rollouts=tuple(
            TrainedRollout(rollout_id=row.rollout_id, reward=row.reward, digest=row_digest(row))
            for group in batch
            for row in group.rows
        ),
    )


def _decode_reply(record: StepRecord) -> Trained:
    return msgspec.msgpack.decode(record.reply, type=Trained)
