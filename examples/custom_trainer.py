"""Plug in a trainer: the quickstart's workload, every actor in this process, with a trainer of our own.

    python3 examples/custom_trainer.py

The controller hands the trainer settled prompt groups in batches of ``trainer.batch_groups``; each
group carries its sealed siblings' canonical rows (token ids per turn, the reward) and the siblings
given up on. This one computes group-relative advantages (reward minus the group's mean, as GRPO
does), prints one line per step and bumps the policy version; a real trainer would update weights and
return where it saved them (``TrainStep.weights_dir``) for the policy to load.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path

from parkway.actors.launch.workload import run_workload
from parkway.actors.run.config import from_dict
from parkway.actors.run.tasks import load_tasks
from parkway.actors.runtime.logs import configure_logging
from parkway.actors.sdk.trainer import GroupResult, Trainer, TrainStep
from parkway.brokers.memory import MemoryBroker, MemoryHub


class AdvantageTrainer(Trainer):
    def __init__(self) -> None:
        self.policy_version = 0
        self.steps = 0

    def train(self, batch: list[GroupResult]) -> TrainStep:
        samples = tokens = 0
        rewards = []
        for group in batch:
            mean = statistics.fmean(row.reward for row in group.rows) if group.rows else 0.0
            for row in group.rows:
                advantage = row.reward - mean  # what a policy-gradient step would weight row's tokens by
                samples += 1
                tokens += sum(len(turn.token_ids) for turn in row.turns)
                rewards.append(row.reward)
                assert abs(advantage) <= 1.0
        self.steps += 1
        self.policy_version += 1
        print(f"step {self.steps}: {len(batch)} groups, {samples} samples, {tokens} tokens")
        return TrainStep(
            step=self.steps,
            policy_version=self.policy_version,
            groups=len(batch),
            samples=samples,
            failed=sum(len(g.failed) for g in batch),
            mean_reward=statistics.fmean(rewards) if rewards else 0.0,
            tokens=tokens,
        )

    def state(self) -> dict[str, object]:  # what a trainer checkpoint keeps
        return {"policy_version": self.policy_version, "steps": self.steps}

    def load_state(self, state: dict[str, object]) -> None:
        self.policy_version = int(str(state["policy_version"]))
        self.steps = int(str(state["steps"]))


async def main() -> None:
    configure_logging(level="warning")  # the actors' JSON lines: warnings only
    config = from_dict(
        {
            "run": "custom-trainer",
            "seed": 7,
            "tasks": {"builtin": "mixed"},
            "policy": {"host": "inline"},
            "trainer": {"batch_groups": 4},
        }
    )
    broker = MemoryBroker(MemoryHub(), config.run)
    await broker.start()
    with tempfile.TemporaryDirectory() as state:
        summary = await run_workload(
            broker,
            b"a secret for this process only",
            config,
            load_tasks(config.tasks),
            embedded=True,
            state_root=Path(state),
            trainer=AdvantageTrainer(),
        )
    await broker.close()
    print(f"{summary.rollouts_sealed} rollouts sealed, {summary.train_steps} train steps")


if __name__ == "__main__":
    asyncio.run(main())
