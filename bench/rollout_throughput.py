"""Rollouts and model calls per second for one workload, embedded and over RabbitMQ.

    python bench/rollout_throughput.py [--tasks 12] [--group-size 4] [--turns 5] [--delay 0.0]

Modes: ``embedded-inline`` (one process, in-memory broker, engine in the policy process),
``embedded-ray`` (engines in Ray actors), ``rabbitmq-processes`` (every actor its own OS process on the
local RabbitMQ, engines in Ray). Prints a table and writes ``bench/results/rollout_throughput.json``.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse
import asyncio
import json
import os
import time
import uuid
from pathlib import Path

import cluster

RESULTS = Path(__file__).resolve().parent / "results"
URL = os.environ.get("PARKWAY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def workload(args: argparse.Namespace, host: str) -> dict:
    return {
        "run": f"bench{uuid.uuid4().hex[:6]}",
        "seed": 1,
        "rollout": {"group_size": args.group_size, "max_turns": args.turns, "max_in_flight": 256},
        "tasks": {"builtin": "mixed", "limit": args.tasks},
        "policy": {"host": host, "engines": 1, "per_token_delay_s": args.delay},
        "topology": {"agents": 2, "resources": 2},
    }


async def embedded(args: argparse.Namespace, host: str) -> dict:
    summary = await cluster.embedded(workload(args, host))
    return {
        "rollouts": summary.rollouts_sealed,
        "model_calls": summary.model_calls,
        "wall_s": summary.wall_s,
        "rollouts_per_s": summary.rollouts_per_s,
        "model_calls_per_s": summary.model_calls_per_s,
    }


def over_rabbitmq(args: argparse.Namespace) -> dict:
    summary = cluster.over_rabbitmq(workload(args, "ray"))
    return {k: summary[k] for k in ("model_calls", "wall_s", "rollouts_per_s", "model_calls_per_s")} | {
        "rollouts": summary["rollouts_sealed"]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.0, help="engine seconds per generated token")
    args = parser.parse_args()
    results = {
        "embedded-inline": asyncio.run(embedded(args, "inline")),
        "embedded-ray": asyncio.run(embedded(args, "ray")),
        "rabbitmq-processes": over_rabbitmq(args),
    }
    print(f"{'mode':<20} {'rollouts':>8} {'calls':>6} {'wall s':>7} {'rollouts/s':>10} {'calls/s':>8}")
    for mode, r in results.items():
        print(
            f"{mode:<20} {r['rollouts']:>8} {r['model_calls']:>6} {r['wall_s']:>7} {r['rollouts_per_s']:>10} "
            f"{r['model_calls_per_s']:>8}"
        )
    RESULTS.mkdir(exist_ok=True)
    record = {
        "bench": "rollout_throughput",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": vars(args),
        "results": results,
    }
    (RESULTS / "rollout_throughput.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
