"""Shared by the benchmarks: start one configuration's cluster, embedded or over RabbitMQ, with the
controller in this process, so a benchmark can drive it (snapshots on its own schedule, a crash at a
chosen moment) and read the controller's own measurements.

Modes:

- ``embedded``: every actor in this process on the in-memory broker (``parkway up``);
- ``rabbitmq``: every actor its own OS process (``parkway actor``) on the local RabbitMQ, the controller
  in this process, exactly as ``parkway run --broker`` runs it.

History (``actors/runtime/history.py``: a record per fact, with its wall-clock time): ``history_roles``
turns it on for those roles' processes over RabbitMQ (embedded, for every actor of the process), under
the cluster's state directory, for a benchmark to read back (``history_records``).

Logs: the benchmark's own process logs at ``warning`` (an info line per turn, rendered for a terminal,
would be measured as framework cost); actor processes log at ``--actor-log-level`` (default warning).
The actor processes are started and stopped by parkway's one launcher (``parkway.actors.launch.processes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Collection, Iterator, Mapping
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
from parkway.actors.runtime.history import HISTORY_ENV, history_dir
from parkway.actors.runtime.logs import configure_logging
from parkway.brokers.base import Broker
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Status, StatusReport

# ``runtime.settings.NICE_ENV``, spelt out: a baseline build measured beside this one may not have it.
NICE_ENV = "PARKWAY_NICE"

URL = os.environ.get("PARKWAY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
SECRET = b"bench"


def build_controller(broker: Broker, config: RunConfig) -> Controller:
    """The controller the measured build makes for this workload (a build from before
    ``workload_controller`` makes a plain one: its own choice, which an interleaved run compares)."""
    from parkway.actors.launch import workload

    make = getattr(workload, "workload_controller", None)
    return make(broker, SECRET, config) if make is not None else Controller(broker, secret=SECRET, replica=0)


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
    history_roles: Collection[str] = (),
    kill_at_end: bool = False,
    nice: Mapping[str, int] | None = None,
) -> AsyncIterator[Cluster]:
    """A cluster of configuration ``data`` (a fresh "machine"; ``state`` reuses a state directory).
    Over RabbitMQ: ``spawn=False`` when the actor processes were started already; the run's queues are
    deleted afterwards unless ``keep_queues``. ``history_roles``: the roles that record their history
    (embedded: any role named turns it on for every actor, as they share this process's environment).
    ``kill_at_end``: the actor processes are killed at the end, not stopped (a cluster that is thrown
    away need not wait for its graceful stop). ``nice``: role -> how much its processes lower their CPU
    priority (``parkway actor --nice``)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    bench_logging()
    config = from_dict(data)
    tasks = load_tasks(config.tasks)
    state = state or Path(tempfile.mkdtemp(prefix="parkway-bench-"))
    processes: list[Process] = []
    broker: Broker
    recording: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if mode == "embedded":
        broker = MemoryBroker(MemoryHub(), config.run)
        if history_roles:
            recording = history_on(state)
    else:
        from parkway.brokers.rabbitmq import RabbitBroker

        end_on_sigterm()
        processes = spawn_actors(data, state, actor_log_level, history_roles, nice) if spawn else []
        broker = RabbitBroker(URL, config.run, connection_name=f"parkway-{config.run}-bench")
    try:
        with recording:
            async with broker:
                controller = build_controller(broker, config)
                yield Cluster(mode, config, tasks, broker, controller, state, processes)
    finally:
        stop_processes(processes, kill=kill_at_end)
        if mode == "rabbitmq" and not keep_queues:
            await delete_run(config)


@contextlib.contextmanager
def history_on(state: Path) -> Iterator[None]:
    """Every actor made in this process meanwhile records its history under ``state``."""
    saved = {name: os.environ.get(name) for name in (HISTORY_ENV, "PARKWAY_STATE_DIR")}
    os.environ[HISTORY_ENV], os.environ["PARKWAY_STATE_DIR"] = "1", str(state)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def history_records(c: Cluster, role: str) -> Iterator[dict[str, Any]]:
    """The history records of ``role``'s actors, as their files hold them (``t``, ``k``, ``r``, ``a``,
    ``i``...: ``parkway.protocol.history``), file by file. A last line cut short is skipped."""
    import json

    for path in sorted(history_dir(c.state, c.config.run).glob(f"{role}-*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut by a process stopped mid-write
                yield json.loads(line)


async def embedded(data: dict[str, Any]) -> RunSummary:
    """One workload of ``data`` to completion, every actor in this process (``bench/vllm_engine.py``)."""
    async with started(data) as c:
        return await c.run()


async def delete_run(config: RunConfig) -> None:
    """Delete a run's queues and exchanges on RabbitMQ (durable: they would outlive the benchmark)."""
    import aio_pika

    # The controller's process declares its own queues and, hosted inline, the trainer's.
    addresses = sorted({f"{role}/{i}" for role, i in roles(config)} | {"controller/0", "trainer/0"})
    try:
        from parkway.brokers.rabbitmq_layout import run_exchanges, run_queues

        queues, exchanges = run_queues(config.run, addresses), run_exchanges(config.run)
    except ImportError:  # a build before the control lanes (snapshot_pause --baseline): one queue each
        prefix = f"pk.{config.run}"
        queues = [*(f"{prefix}.q.{a}" for a in addresses), f"{prefix}.dead", f"{prefix}.logs"]
        exchanges = [prefix, f"{prefix}.dlx", f"{prefix}.logs"]
    connection = await aio_pika.connect(URL.split(",")[0])  # a node list: its first node
    async with connection:
        for kind, name in [("queue", q) for q in queues] + [("exchange", e) for e in exchanges]:
            with contextlib.suppress(Exception):  # one channel each: an error closes its channel
                async with connection.channel() as channel:
                    if kind == "queue":
                        await channel.queue_delete(name)
                    else:
                        await channel.exchange_delete(name)


def end_on_sigterm() -> None:
    """A SIGTERM to the benchmark ends it as Ctrl-C does, through every ``finally``: its clusters' actor
    processes are stopped. (With the default handler the benchmark died at once and left them running.)"""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def spawn_actors(
    data: dict[str, Any],
    state: Path,
    log_level: str,
    history_roles: Collection[str] = (),
    nice: Mapping[str, int] | None = None,
) -> list[Process]:
    """Every actor of ``data`` as its own ``parkway actor`` process on the local RabbitMQ (their logs go
    to this process's stderr); those of ``history_roles`` record their history, those of ``nice`` lower
    their CPU priority by its value (``PARKWAY_NICE``: a build that has no such setting ignores it)."""
    config = from_dict(data)
    state.mkdir(parents=True, exist_ok=True)
    config_path = state / "run.yaml"
    config_path.write_text(yaml.safe_dump(data))
    # (Without this process's PARKWAY_* settings but the file exporter's file: launch.run_environment.)
    env = launch.run_environment(run=config.run, secret=SECRET.decode(), state=state, broker_url=URL)
    return [
        launch.start_actor(
            role, i, env=actor_env(env, role, history_roles, nice), config=config_path, log_level=log_level
        )
        for role, i in roles(config)
    ]


def actor_env(
    env: Mapping[str, str], role: str, history_roles: Collection[str], nice: Mapping[str, int] | None
) -> dict[str, str]:
    """One role's processes' environment: the run's, and the history and priority settings of its role."""
    own = {**env, HISTORY_ENV: "1"} if role in history_roles else dict(env)
    if nice and nice.get(role):
        own[NICE_ENV] = str(nice[role])
    return own


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
