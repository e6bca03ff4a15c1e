"""The admission-closed window of a snapshot (``pause_ms``) against rollouts in flight.

    python bench/snapshot_pause.py [--in-flight 16 256] [--delay 0.002] [--interval 0.5]

Each point runs one workload with snapshots every ``--interval`` seconds and the engine's simulated
per-token time ``--delay`` (so rollouts are mid-turn when a snapshot comes), embedded and with every
actor its own process on the local RabbitMQ. Prints p50/p95/max and writes
``bench/results/snapshot_pause.json``. Not a test: nothing here asserts on time.
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

import yaml
from parkway.actors.config import from_dict
from parkway.actors.tasks import load_tasks
from parkway.actors.workload import run_workload
from parkway.brokers.memory import MemoryBroker, MemoryHub

RESULTS = Path(__file__).resolve().parent / "results"
URL = os.environ.get("PARKWAY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
ROLES = [("tq", 0), ("policy", 0), ("resources", 0), ("resources", 1), ("agent", 0), ("agent", 1)]


def workload(in_flight: int, args: argparse.Namespace) -> dict:
    tasks = min(8, in_flight)  # rollouts in flight = tasks x group size
    group_size = max(1, in_flight // tasks)
    return {
        "run": f"pause{uuid.uuid4().hex[:6]}",
        "rollout": {"group_size": group_size, "max_turns": 6, "max_in_flight": in_flight},
        "tasks": {"builtin": "mixed", "limit": tasks},
        "policy": {"host": "inline", "per_token_delay_s": args.delay},
        "snapshot_interval_s": args.interval,
    }


async def embedded(data: dict) -> dict:
    config = from_dict(data)
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
        "rollouts": summary.rollouts_expected,
        "snapshots": summary.snapshots_published,
        **summary.pause_ms,
        "steps_ms": summary.snapshot_steps_ms,
    }


def over_rabbitmq(data: dict) -> dict:
    state = Path(tempfile.mkdtemp(prefix="parkway-pause-"))
    config_path = state / "run.yaml"
    config_path.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARKWAY_")}
    env.update(
        PARKWAY_RUN=data["run"], PARKWAY_SECRET="bench", PARKWAY_STATE_DIR=str(state), PARKWAY_BROKER_URL=URL
    )
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
        for role, i in ROLES
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
    return {
        "rollouts": summary["rollouts_expected"],
        "snapshots": summary["snapshots_published"],
        **summary["pause_ms"],
        "steps_ms": summary["snapshot_steps_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--delay", type=float, default=0.002)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    rows = []
    for n in args.in_flight:
        rows.append({"mode": "embedded", "in_flight": n, **asyncio.run(embedded(workload(n, args)))})
        rows.append({"mode": "rabbitmq-processes", "in_flight": n, **over_rabbitmq(workload(n, args))})
    print(f"{'mode':<20} {'in flight':>9} {'snapshots':>9} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
    for r in rows:
        print(
            f"{r['mode']:<20} {r['rollouts']:>9} {r['snapshots']:>9} {r['p50']:>8} {r['p95']:>8} {r['max']:>8}"
        )
        print("    steps (p50 ms): " + ", ".join(f"{k} {v:.1f}" for k, v in r["steps_ms"].items()))
    RESULTS.mkdir(exist_ok=True)
    record = {
        "bench": "snapshot_pause",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": vars(args),
        "results": rows,
    }
    (RESULTS / "snapshot_pause.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
