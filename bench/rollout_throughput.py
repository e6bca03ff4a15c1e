"""Rollouts and model calls per second for one workload, embedded and over RabbitMQ.

    python bench/rollout_throughput.py [--tasks 12] [--group-size 4] [--turns 5] [--delay 0.0]

Modes: ``embedded-inline`` (one process, in-memory broker, engine in the policy process),
``embedded-ray`` (engines in Ray actors), ``rabbitmq-processes`` (every actor its own OS process on the
local RabbitMQ, engines in Ray). Prints a table and writes ``bench/results/rollout_throughput.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from parkway.actors.config import from_dict
from parkway.actors.tasks import load_tasks
from parkway.actors.workload import run_workload
from parkway.brokers.memory import MemoryBroker, MemoryHub

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
    config = from_dict(workload(args, host))
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        summary = await run_workload(
            broker,
            b"bench",
            config,
            load_tasks(config.tasks),
            embedded=True,
            state_root=Path(tempfile.mkdtemp()),
        )
    return {
        "rollouts": summary.rollouts_sealed,
        "model_calls": summary.model_calls,
        "wall_s": summary.wall_s,
        "rollouts_per_s": summary.rollouts_per_s,
        "model_calls_per_s": summary.model_calls_per_s,
    }


def over_rabbitmq(args: argparse.Namespace) -> dict:
    import yaml

    data = workload(args, "ray")
    state = Path(tempfile.mkdtemp(prefix="parkway-bench-"))
    config_path = state / "run.yaml"
    config_path.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARKWAY_")}
    env.update(
        PARKWAY_RUN=data["run"], PARKWAY_SECRET="bench", PARKWAY_STATE_DIR=str(state), PARKWAY_BROKER_URL=URL
    )
    roles = [("tq", 0), ("policy", 0), ("resources", 0), ("resources", 1), ("agent", 0), ("agent", 1)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "parkway.actors.cli",
                "actor",
                role,
                "--replica",
                str(i),
                "--config",
                str(config_path),
                "--log-level",
                "warning",
            ],
            env=env,
        )
        for role, i in roles
    ]
    try:
        result = subprocess.run(
            [sys.executable, "-m", "parkway.actors.cli", "run", "--config", str(config_path), "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    summary = json.loads(result.stdout)
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
