"""What the controller knows of its run and a snapshot carries: the ledger, the task cursor, the
trainer's anchor and what the trainer received, kept as sums so that nothing grows with the run."""

from __future__ import annotations

import hashlib
from collections import Counter

from parkway.protocol.anchor import ControllerAnchor, transcripts_hex
from parkway.protocol.ids import parse_task_group_id, task_group_id
from parkway.protocol.ledger import Ledger
from parkway.protocol.messages import TrainedRollout
from parkway.protocol.training import InTraining


class RunState:
    def __init__(self) -> None:
        self.ledger = Ledger()
        self.policy_version = 0
        self.epoch = 1  # this controller's incarnation: +1 per restore, stamped on every Run
        # The newest epoch a participant reported: a restore runs above it, so a second restore of
        # the same snapshot never reuses the epoch of the controller that died after the first.
        self.epochs_seen = 0
        # The ledger holds the groups in play; the tasks after the cursor have not been admitted yet.
        self.next_task = 0
        self.first_in_play = 0  # restored from an anchor: the groups before it were all trained
        self.sealed = 0  # logical rollouts whose final attempt the trainer received
        self.reward_sum = 0.0
        self.transcripts = 0  # sum of each trained rollout's token digest, mod 2**256
        self.trained_groups: list[str] = []  # group ids the trainer consumed, those still in play
        self.training: InTraining | None = None  # handed to the trainer, not answered yet
        self.session = 0  # the tag in this run's group ids (``ids.task_group_id``); 0: none

    def group_id(self, task_index: int) -> str:
        """The group id of a task in this session of the run."""
        return task_group_id(task_index, self.session)

    def trained(self, rollout: TrainedRollout) -> None:
        """The trainer received this rollout."""
        self.sealed += 1
        self.reward_sum += rollout.reward
        self.transcripts = (self.transcripts + int(rollout.digest, 16)) % 2**256

    def transcripts_sha256(self) -> str:
        """One digest of every trained rollout's token ids (same seeds, same digest): each rollout's
        digest is added when the trainer receives it (TQ then drops its rows), in any order."""
        return hashlib.sha256(f"{self.sealed}:{self.transcripts:064x}".encode()).hexdigest()

    def mean_reward(self) -> float:
        return self.reward_sum / self.sealed if self.sealed else 0.0

    def prune_trained(self) -> int:
        """Drop the trained groups before the first in play (every group before it was trained, so
        ``first_in_play`` says it): the rest is bounded by the groups admitted and in play. Returns
        the first task in play."""
        first = min((g.task_index for g in self.ledger.groups.values()), default=self.next_task)
        self.trained_groups = [g for g in self.trained_groups if parse_task_group_id(g) >= first]
        return first

    def anchor(self, counts: Counter[str]) -> ControllerAnchor:
        """What is saved beside the ledger. ``first_in_play``: every group before it was trained;
        ``trained_groups`` names the trained ones from there to the cursor (the older are dropped)."""
        first = self.prune_trained()
        return ControllerAnchor(
            policy_version=self.policy_version,
            epoch=self.epoch,
            train_steps=counts["train_steps"],
            next_task=self.next_task,
            first_in_play=first,
            sealed=self.sealed,
            reward_sum=self.reward_sum,
            transcripts=transcripts_hex(self.transcripts),
            trained_groups=list(self.trained_groups),
            counts={k: v for k, v in counts.items() if not k.startswith(("error:", "refused:"))},
            training=self.training,
            session=self.session,
        )

    def take_anchor(self, anchor: ControllerAnchor, *, task_count: int) -> None:
        """Continue from a saved anchor (the ledger is taken separately). Its epoch ended with the
        controller that wrote it, and any the participants were restored to since: this one runs
        as the next."""
        self.policy_version = anchor.policy_version
        self.epoch = max(anchor.epoch, self.epochs_seen) + 1
        self.sealed, self.reward_sum = anchor.sealed, anchor.reward_sum
        self.transcripts = anchor.transcripts_sum
        # Before the cursor every task was admitted at the start: all of them are in that ledger.
        self.next_task = anchor.next_task if anchor.next_task is not None else task_count
        self.first_in_play = anchor.first_in_play
        self.trained_groups = list(anchor.trained_groups)
        self.training = anchor.training
        self.session = anchor.session
