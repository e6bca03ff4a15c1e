"""``ledger-advantage``: a trainer of the package's own, written against the public API only.

It computes each sibling's group-relative advantage (its reward minus its group's mean, as GRPO does)
and keeps running totals; it updates no weights (a learning trainer returns ``TrainStep.weights_dir``
for the policy to load). Its state is plain data, so a trainer checkpoint and a restore round-trip it.
"""

from __future__ import annotations

import statistics

from parkway.actors.sdk import GroupResult, Trainer, TrainStep


class LedgerAdvantage(Trainer):
    def __init__(self, start_version: int = 0) -> None:
        self.policy_version = start_version
        self.steps = 0
        self.samples = 0
        self.advantage_sum = 0.0  # stays 0 up to rounding: a check that every group was complete

    def train(self, batch: list[GroupResult]) -> TrainStep:
        rewards, tokens = [], 0
        for group in batch:
            mean = statistics.fmean(row.reward for row in group.rows) if group.rows else 0.0
            for row in group.rows:
                self.advantage_sum += row.reward - mean
                rewards.append(row.reward)
                tokens += sum(len(turn.token_ids) for turn in row.turns)
        self.steps += 1
        self.samples += len(rewards)
        self.policy_version += 1
        return TrainStep(
            step=self.steps,
            policy_version=self.policy_version,
            groups=len(batch),
            samples=len(rewards),
            failed=sum(len(group.failed) for group in batch),
            mean_reward=statistics.fmean(rewards) if rewards else 0.0,
            tokens=tokens,
        )

    def state(self) -> dict[str, object]:
        return {
            "policy_version": self.policy_version,
            "steps": self.steps,
            "samples": self.samples,
            "advantage_sum": self.advantage_sum,
        }

    def load_state(self, state: dict[str, object]) -> None:
        version, steps, samples, total = (
            state["policy_version"],
            state["steps"],
            state["samples"],
            state["advantage_sum"],
        )
        if not (isinstance(version, int) and isinstance(steps, int) and isinstance(samples, int)):
            raise ValueError(f"ledger-advantage state {state!r}: counts must be ints")
        if not isinstance(total, int | float):
            raise ValueError(f"ledger-advantage state {state!r}: advantage_sum must be a number")
        self.policy_version, self.steps, self.samples, self.advantage_sum = (
            version,
            steps,
            samples,
            float(total),
        )
