"""The admission-closed window of a snapshot (``pause_ms``) against rollouts in flight.

    python bench/snapshot_pause.py [--in-flight 16 256] [--delay 0.002] [--interval 0.5]

Each point runs one workload with snapshots every ``--interval`` seconds and the engine's simulated
per-token time ``--delay`` (so rollouts are mid-turn when a snapshot comes), embedded and with every
actor its own process on the local RabbitMQ. Prints p50/p95/max and writes
``bench/results/snapshot_pause.json``. Not a test: nothing here asserts on time.
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
    summary = await cluster.embedded(data)
    return {
        "rollouts": summary.rollouts_expected,
        "snapshots": summary.snapshots_published,
        **summary.pause_ms,
        "steps_ms": summary.snapshot_steps_ms,
    }


def over_rabbitmq(data: dict) -> dict:
    summary = cluster.over_rabbitmq(data)
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
