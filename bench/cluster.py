"""Shared by the benchmarks: run one configuration embedded, or as separate processes on RabbitMQ."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from parkway.actors.config import from_dict
from parkway.actors.controller import RunSummary
from parkway.actors.tasks import load_tasks
from parkway.actors.workload import run_workload
from parkway.brokers.memory import MemoryBroker, MemoryHub

URL = os.environ.get("PARKWAY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def roles(data: dict[str, Any]) -> list[tuple[str, int]]:
    topology = data.get("topology", {})
    return [("tq", 0), ("policy", 0)] + [
        (role, i)
        for role in ("resources", "agent")
        for i in range(topology.get(f"{role}s" if role == "agent" else role, 2))
    ]


async def embedded(data: dict[str, Any]) -> RunSummary:
    config = from_dict(data)
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        return await run_workload(
            broker,
            b"bench",
            config,
            load_tasks(config.tasks),
            embedded=True,
            state_root=Path(tempfile.mkdtemp(prefix="parkway-bench-")),
        )


def over_rabbitmq(data: dict[str, Any]) -> dict[str, Any]:
    """Every actor its own process (``parkway actor``), driven by ``parkway run --broker``; the summary."""
    state = Path(tempfile.mkdtemp(prefix="parkway-bench-"))
    config_path = state / "run.yaml"
    config_path.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARKWAY_")}
    env.update(
        PARKWAY_RUN=data["run"], PARKWAY_SECRET="bench", PARKWAY_STATE_DIR=str(state), PARKWAY_BROKER_URL=URL
    )
    cli = [sys.executable, "-m", "parkway.actors.cli"]
    procs = [
        subprocess.Popen(
            [
                *cli,
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
        for role, i in roles(data)
    ]
    try:
        result = subprocess.run(
            [*cli, "run", "--config", str(config_path), "--json"],
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
    return json.loads(result.stdout)
