"""On-policy admission: whole batches, each dispatched only after the one before was trained and its
weights loaded, so the weights every generation ran on follow from its batch index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parkway.actors.sdk.trainer import GroupResult, Trainer, TrainStep

from tests.support.embedded import embedded_run


class Recording(Trainer):
    """Records, per batch, its groups and the policy versions its rows were generated on; every step
    has new weights (a directory) for the policy to load."""

    def __init__(self, weights_root: Path) -> None:
        self.weights_root = weights_root
        self.batches: list[tuple[tuple[str, ...], frozenset[int]]] = []
        self.prompts_missing = 0
        self.step = 0

    def train(self, batch: list[GroupResult]) -> TrainStep:
        versions = frozenset(t.policy_version for g in batch for r in g.rows for t in r.turns)
        self.prompts_missing += sum(not t.prompt_token_ids for g in batch for r in g.rows for t in r.turns)
        self.batches.append((tuple(g.group_id for g in batch), versions))
        self.step += 1
        weights = self.weights_root / f"step-{self.step}"
        weights.mkdir(parents=True)
        rows = [r for g in batch for r in g.rows]
        return TrainStep(
            step=self.step,
            policy_version=self.step,
            groups=len(batch),
            samples=len(rows),
            failed=0,
            mean_reward=0.0,
            tokens=0,
            weights_dir=str(weights),
        )

    def state(self) -> dict[str, object]:
        return {"policy_version": self.step}

    def load_state(self, state: dict[str, object]) -> None:
        # Only the trainer actor's sync to step 0 at the start: these runs never restore a later step.
        assert state == {"policy_version": 0}, state
        self.step = 0


def on_policy_config(on_policy: bool) -> dict[str, Any]:
    return {
        "run": "onpol",
        "seed": 2,
        "agent": "submit",
        "environments": ["letters"],
        "policy": {"host": "inline", "per_token_delay_s": 0.0002},
        "tasks": {"builtin": "letters", "limit": 4},
        "rollout": {"group_size": 2, "max_turns": 1, "max_tokens": 16},
        "trainer": {"batch_groups": 2, "on_policy": on_policy},
    }


async def test_on_policy_batches_run_on_the_weights_of_the_step_before(tmp_path: Path) -> None:
    data = on_policy_config(True)
    data["tasks"]["limit"] = 5
    trainer = Recording(tmp_path / "weights")
    summary = await embedded_run(data, tmp_path / "state", snapshots=False, trainer=trainer)
    assert summary.rollouts_sealed == 10 and summary.train_steps == 3
    assert trainer.batches == [
        (("t0000", "t0001"), frozenset({0})),
        (("t0002", "t0003"), frozenset({1})),
        (("t0004",), frozenset({2})),
    ]
    assert trainer.prompts_missing == 0  # every staging row carries the prompt it was generated from


async def test_two_on_policy_runs_of_one_seed_are_identical(tmp_path: Path) -> None:
    first, second = Recording(tmp_path / "w1"), Recording(tmp_path / "w2")
    a = await embedded_run(on_policy_config(True), tmp_path / "a", snapshots=False, trainer=first)
    b = await embedded_run(on_policy_config(True), tmp_path / "b", snapshots=False, trainer=second)
    assert a.rollouts_sealed == b.rollouts_sealed == 8
    assert first.batches == second.batches and len(first.batches) == 2
    assert a.transcripts_sha256 == b.transcripts_sha256
