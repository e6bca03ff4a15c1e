"""The trainer parkway ships: records batch statistics and bumps the policy version."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from parkway.actors.sdk.trainer import GroupResult, Trainer, TrainStep


@dataclass
class ExampleTrainer(Trainer):
    """Records batch statistics and bumps the policy version, as a real trainer's update would."""

    policy_version: int = 0
    trained: int = 0  # steps trained (a count, not a list: a run of millions of rollouts trains for days)

    def train(self, batch: list[GroupResult]) -> TrainStep:
        rows = [row for group in batch for row in group.rows]
        self.policy_version += 1
        self.trained += 1
        step = TrainStep(
            step=self.trained,
            policy_version=self.policy_version,
            groups=len(batch),
            samples=len(rows),
            failed=sum(len(g.failed) for g in batch),
            mean_reward=statistics.fmean(r.reward for r in rows) if rows else 0.0,
            tokens=sum(len(t.token_ids) for r in rows for t in r.turns),
        )
        return step

    def state(self) -> dict[str, object]:
        return {"policy_version": self.policy_version, "steps": self.trained}

    def load_state(self, state: dict[str, object]) -> None:
        version = state["policy_version"]
        if not isinstance(version, int):
            raise ValueError(f"trainer state: policy_version {version!r} is not an int")
        self.policy_version = version
