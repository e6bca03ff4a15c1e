"""vLLM in the policy's Ray actors: tokens per second, and the snapshot pause of a workload on it.

    python bench/vllm_engine.py MODEL_DIR [--gpu] [--concurrency 8] [--max-tokens 128]

On a GPU machine pass a real model directory and ``--gpu`` (no explicit KV cache size, 85% of GPU
memory); on this CPU machine ``parkway model build /tmp/tiny`` makes a model to point it at. Prints a
table and writes ``bench/results/vllm_engine.json``. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import cluster
import common
from parkway.actors.engines.base import GenerationRequest
from parkway.actors.engines.ray_host import EnginePool, EngineSpec


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs: dict = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.gpu:
        kwargs.update(kv_cache_memory_bytes=None, gpu_memory_utilization=0.85, dtype="bfloat16")
    return kwargs


async def tokens_per_second(args: argparse.Namespace) -> dict:
    actor_options = {"num_gpus": args.tensor_parallel_size} if args.gpu else {}
    pool = EnginePool(
        EngineSpec(kind="vllm", kwargs=engine_kwargs(args)),
        host="ray",
        replicas=1,
        actor_options=actor_options,
    )
    started = time.perf_counter()
    await pool.start()
    start_s = time.perf_counter() - started
    prompt = tuple(range(10, 10 + args.prompt_tokens))
    requests = [
        GenerationRequest(f"b{i}", prompt, seed=i, max_tokens=args.max_tokens)
        for i in range(args.concurrency)
    ]
    await pool.generate(GenerationRequest("warm", prompt, seed=0, max_tokens=8))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(pool.generate(r) for r in requests))
    elapsed = time.perf_counter() - t0
    await pool.stop()
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "engine_start_s": round(start_s, 1),
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
        "concurrency": args.concurrency,
    }


def snapshot_pause(args: argparse.Namespace) -> dict:
    data = {
        "run": f"vb{uuid.uuid4().hex[:6]}",
        "agent": "counter",
        "rollout": {"group_size": 4, "max_turns": 5, "max_tokens": args.max_tokens},
        "tasks": {"builtin": "counter", "limit": 4},
        "snapshot_interval_s": 1.0,
        "policy": {
            "engine": "vllm",
            "host": "ray",
            **{k: v for k, v in engine_kwargs(args).items() if k != "dtype"},
        },
    }
    summary = asyncio.run(cluster.embedded(data))
    return {
        "rollouts": summary.rollouts_sealed,
        "snapshots": summary.snapshots_published,
        "pause_ms": summary.pause_ms,
    }


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("model")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    speed = asyncio.run(tokens_per_second(args))
    pause = snapshot_pause(args)
    print(
        f"engine start {speed['engine_start_s']} s; {speed['tokens_per_s']} tokens/s over "
        f"{speed['concurrency']} concurrent requests"
    )
    print(
        f"workload: {pause['rollouts']} rollouts, {pause['snapshots']} snapshots, pause_ms {pause['pause_ms']}"
    )
    record = {
        "bench": "vllm_engine",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": vars(args),
        "speed": speed,
        "workload": pause,
    }
    common.write_json("vllm_engine", record)


if __name__ == "__main__":
    main()
