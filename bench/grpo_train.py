"""The GRPO learning example's costs on this machine: a trainer step, and vLLM loading its weights.

    python bench/grpo_train.py MODEL_DIR [--rounds 3] [--steps 5]

A round is ``--steps`` GRPO steps (2 groups x 8 siblings, a 30-token prompt and 24 sampled tokens
each, as in examples/grpo.yaml) followed by vLLM (in this process, the engine the policy runs)
loading each step's weights in place; rounds interleave the two, and the medians over every round
are printed and written to ``bench/results/grpo_train.json``. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from parkway.actors.builtin.grpo import GrpoTrainer
from parkway.actors.engines.vllm_engine import VllmEngine
from parkway.actors.sdk.trainer import GroupResult
from parkway.protocol.messages import CanonicalRow, StagingRow


def batch(rng: random.Random, version: int) -> list[GroupResult]:
    groups = []
    for g in range(2):
        prompt = tuple(rng.randrange(3, 400) for _ in range(30))
        rows = tuple(
            CanonicalRow(
                rollout_id=f"t{g}_g{s}",
                attempt=0,
                capture_key=f"t{g}_g{s}",
                reward=rng.random(),
                turns=(
                    StagingRow(
                        capture_key=f"t{g}_g{s}",
                        turn=0,
                        token_ids=tuple(rng.randrange(3, 400) for _ in range(24)),
                        prompt_token_ids=prompt,
                        policy_version=version,
                    ),
                ),
            )
            for s in range(8)
        )
        groups.append(GroupResult(f"t{g}", g, rows, ()))
    return groups


async def main(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    work = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    trainer = GrpoTrainer(model=args.model, work_dir=str(work), lr=0.03, seed=1)
    engine = VllmEngine(args.model, max_model_len=512)
    started = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - started
    load_before = os.getloadavg()[0]  # a figure counts with the load it was taken under
    step_s: list[float] = []
    load_s: list[float] = []
    for _ in range(args.rounds):
        directories = []
        for _ in range(args.steps):
            began = time.perf_counter()
            step = trainer.train(batch(rng, trainer.step))
            step_s.append(time.perf_counter() - began)
            assert step.weights_dir is not None
            directories.append(step.weights_dir)
        for directory in directories:
            began = time.perf_counter()
            await engine.load_weights(directory)
            load_s.append(time.perf_counter() - began)
    await engine.stop()
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "engine_start_s": round(start_s, 2),
        "train_step_ms_median": round(statistics.median(step_s) * 1000, 1),
        "train_step_ms_max": round(max(step_s) * 1000, 1),
        "weight_load_ms_median": round(statistics.median(load_s) * 1000, 1),
        "weight_load_ms_max": round(max(load_s) * 1000, 1),
        "steps": len(step_s),
        "loads": len(load_s),
    }
    write_result(result)
    return result


def write_result(result: dict) -> None:
    out = Path(__file__).resolve().parent / "results" / "grpo_train.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":  # vLLM spawns its engine processes
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
