"""Shared by the benchmarks: start one configuration's cluster, embedded or over RabbitMQ, with the
controller in this process, so a benchmark can drive it (snapshots on its own schedule, a crash at a
chosen moment) and read the controller's own measurements.

Modes:

- ``embedded``: every actor in this process on the in-memory broker (``parkway up``);
- ``rabbitmq``: every actor its own OS process (``parkway actor``) on the local RabbitMQ, the controller
  in this process, exactly as ``parkway run --broker`` runs it.

Logs: the benchmark's own process logs at ``warning`` (an info line per turn, rendered for a terminal,
would be measured as framework cost); actor processes log at ``--actor-log-level`` (default warning).
The actor processes are started and stopped by parkway's one launcher (``parkway.actors.launch.processes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from common import MODES
from parkway.actors.launch import processes as launch
from parkway.actors.launch.processes import Process
from parkway.actors.launch.workload import run_workload
from parkway.actors.roles.controller.controller import Controller, RunSummary
from parkway.actors.run.config import RunConfig, from_dict
from parkway.actors.run.tasks import Task, load_tasks
from parkway.actors.runtime.logs import configure_logging
from parkway.brokers.base import Broker
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Status, StatusReport

URL = os.environ.get("PARKWAY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
SECRET = b"bench"


def bench_logging() -> None:
    """This process's actors log JSON lines to stderr, warnings only unless ``PARKWAY_BENCH_LOG_LEVEL``.
    Called when a cluster starts, not on import: a test importing a bench must not reconfigure the
    logging of every test after it (``capture_logs`` would see nothing below the level)."""
    configure_logging(level=os.environ.get("PARKWAY_BENCH_LOG_LEVEL", "warning"), stream=sys.stderr)


def roles(config: RunConfig) -> list[tuple[str, int]]:
    return launch.service_roles(config)


@dataclass
class Cluster:
    """A started cluster: its broker connection in this process, the controller, the configuration."""

    mode: str
    config: RunConfig
    tasks: list[Task]
    broker: Broker
    controller: Controller
    state: Path
    processes: list[Process] = field(default_factory=list)

    async def run(self, **kwargs: Any) -> RunSummary:
        """The workload to completion (``run_workload``); keywords go to it (``stop_after_snapshots``...)."""
        return await run_workload(
            self.broker,
            SECRET,
            self.config,
            self.tasks,
            embedded=self.mode == "embedded",
            state_root=self.state,
            controller=self.controller,
            **kwargs,
        )

    async def status(self, address: str) -> StatusReport:
        """An actor's ``Status``: its counters, its messages in flight, its phase."""
        reply = await self.controller.client.request(
            address, Status(checkpoint_id=f"bench-{time.monotonic_ns()}", deadline=time.time() + 10)
        )
        assert isinstance(reply, StatusReport), reply
        return reply

    async def counts(self, address: str) -> dict[str, int]:
        """An actor's counters (``Status``), e.g. the policy's ``tokens_generated``."""
        return dict((await self.status(address)).counts)


@contextlib.asynccontextmanager
async def started(
    data: dict[str, Any],
    mode: str = "embedded",
    *,
    state: Path | None = None,
    actor_log_level: str = "warning",
    keep_queues: bool = False,
    spawn: bool = True,
) -> AsyncIterator[Cluster]:
    """A cluster of configuration ``data`` (a fresh "machine"; ``state`` reuses a state directory).
    Over RabbitMQ: ``spawn=False`` when the actor processes were started already; the run's queues are
    deleted afterwards unless ``keep_queues``."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    bench_logging()
    config = from_dict(data)
    tasks = load_tasks(config.tasks)
    state = state or Path(tempfile.mkdtemp(prefix="parkway-bench-"))
    processes: list[Process] = []
    broker: Broker
    if mode == "embedded":
        broker = MemoryBroker(MemoryHub(), config.run)
    else:
        from parkway.brokers.rabbitmq import RabbitBroker

        processes = spawn_actors(data, state, actor_log_level) if spawn else []
        broker = RabbitBroker(URL, config.run, connection_name=f"parkway-{config.run}-bench")
    try:
        async with broker:
            controller = Controller(broker, secret=SECRET, replica=0)
            yield Cluster(mode, config, tasks, broker, controller, state, processes)
    finally:
        stop_processes(processes)
        if mode == "rabbitmq" and not keep_queues:
            await delete_run(config)


async def embedded(data: dict[str, Any]) -> RunSummary:
    """One workload of ``data`` to completion, every actor in this process (``bench/vllm_engine.py``)."""
    async with started(data) as c:
        return await c.run()


async def delete_run(config: RunConfig) -> None:
    """Delete a run's queues and exchanges on RabbitMQ (durable: they would outlive the benchmark)."""
    import aio_pika

    prefix = f"pk.{config.run}"
    addresses = [f"{role}/{i}" for role, i in roles(config)] + ["controller/0"]
    connection = await aio_pika.connect(URL)
    async with connection:
        queues = [f"{prefix}.q.{a}" for a in addresses] + [f"{prefix}.dead", f"{prefix}.logs"]
        for kind, name in [("queue", q) for q in queues] + [
            ("exchange", e) for e in (prefix, f"{prefix}.dlx", f"{prefix}.logs")
        ]:
            with contextlib.suppress(Exception):  # one channel each: an error closes its channel
                async with connection.channel() as channel:
                    if kind == "queue":
                        await channel.queue_delete(name)
                    else:
                        await channel.exchange_delete(name)


def spawn_actors(data: dict[str, Any], state: Path, log_level: str) -> list[Process]:
    """Every actor of ``data`` as its own ``parkway actor`` process on the local RabbitMQ (their logs go
    to this process's stderr)."""
    config = from_dict(data)
    state.mkdir(parents=True, exist_ok=True)
    config_path = state / "run.yaml"
    config_path.write_text(yaml.safe_dump(data))
    env = launch.run_environment(run=config.run, secret=SECRET.decode(), state=state, broker_url=URL)
    return [
        launch.start_actor(role, i, env=env, config=config_path, log_level=log_level)
        for role, i in roles(config)
    ]


def stop_processes(processes: list[Process], *, kill: bool = False) -> None:
    """SIGTERM and 30 s to go (``kill``: SIGKILL at once, the benchmark's crash), then reap."""
    if kill:
        launch.kill_all(processes, timeout=30)
    else:
        launch.stop_all(processes, grace=30)


async def cancel(task: asyncio.Task[Any]) -> None:
    """Stop a workload dead (the benchmark's stand-in for killing the cluster)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def tasks_file(prompts: int, *, turns: tuple[int, int] | None = None) -> Path:
    """A JSONL of ``prompts`` tasks cycling through the built-in mixed ones; ``turns=(low, high)`` gives
    them ``low`` to ``high`` turns (rollouts of unequal length finish steadily, not in waves)."""
    import json

    from parkway.actors.run.tasks import BUILTIN

    mixed = BUILTIN["mixed"]
    path = Path(tempfile.mkdtemp(prefix="parkway-bench-tasks-")) / "tasks.jsonl"
    lines = []
    for i in range(prompts):
        task = {"env": mixed[i % len(mixed)].env, "prompt": mixed[i % len(mixed)].prompt}
        if turns is not None:
            task["max_turns"] = turns[0] + i % (turns[1] - turns[0] + 1)
        lines.append(json.dumps(task))
    path.write_text("\n".join(lines) + "\n")
    return path
