"""Prometheus metrics of real actors on the in-memory broker, read from each actor's own registry."""

from __future__ import annotations

import asyncio
import math
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from parkway.actors.builtin.trainers import ExampleTrainer
from parkway.actors.launch.service import serve
from parkway.actors.launch.workload import embedded_actors, run_workload
from parkway.actors.roles.agent import Agent
from parkway.actors.roles.controller.controller import Controller
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.run.config import from_dict
from parkway.actors.run.tasks import load_tasks
from parkway.actors.runtime.actor import Actor
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.metrics import MetricsEndpoint, process_registry
from parkway.actors.runtime.settings import RunSettings, SettingsError
from parkway.actors.sdk.trainer import GroupResult, TrainStep
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.errors import ErrorCode
from parkway.protocol.messages import (
    AttemptRef,
    Commit,
    Committed,
    Error,
    Ok,
    Prepare,
    Prepared,
    Probe,
    ProbeResult,
    Resume,
    Retire,
    Run,
    Status,
    StatusReport,
)
from prometheus_client.parser import text_string_to_metric_families

from tests.support.signed import SECRET, raw_request, signed_raw
from tests.support.waiting import until

RUN = "unit"


@pytest.fixture
async def broker():
    async with MemoryBroker(MemoryHub(), RUN) as b:
        yield b


@pytest.fixture
async def client(broker: MemoryBroker) -> Client:
    return Client(broker, secret=SECRET, sender="controller/0")


@pytest.fixture
async def tq(broker: MemoryBroker, tmp_path: Path):
    actor = TransferQueue(broker, secret=SECRET, replica=0, snapshot_root=tmp_path / "snapshots")
    await actor.start()
    yield actor
    await actor.stop()


def soon() -> float:
    return time.time() + 10


def value(actor: Actor, name: str, **labels: str) -> float:
    """A sample of ``actor``'s registry (0 when it has none yet)."""
    labels = {"role": actor.role, "replica": str(actor.replica), **labels}
    found = actor.metrics.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def messages(actor: Actor, kind: str, outcome: str) -> float:
    return value(actor, "parkway_messages_total", type=kind, outcome=outcome)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_released(port: int) -> None:
    """Nothing listens on ``port`` any more: a new server may bind it (as servers do, with SO_REUSEADDR,
    past the TIME_WAIT of connections just served; a listening socket would still refuse it)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen()


async def test_messages_are_counted_by_type_and_outcome(tq: Actor, client: Client) -> None:
    assert isinstance(await client.request("tq/0", Probe(checkpoint_id="p-1", deadline=soon())), ProbeResult)
    assert isinstance(await client.request("tq/0", Probe(checkpoint_id="p-1", deadline=soon())), ProbeResult)
    assert isinstance(
        await client.request("tq/0", Status(checkpoint_id="s-1", deadline=soon())), StatusReport
    )
    assert messages(tq, "Probe", "handled") == 1
    assert messages(tq, "Probe", "replayed") == 1  # the same id again: answered from the reply cache
    assert messages(tq, "Status", "handled") == 1
    assert value(tq, "parkway_errors_total", code="invalid_message") == 0  # every code is there from zero


async def test_a_malformed_message_counts_a_refusal_and_its_error_code(
    tq: Actor, client: Client, broker: MemoryBroker
) -> None:
    reply = await raw_request(
        client, "tq/0", signed_raw(RUN, b"{not json", correlation_id="bad-1", to="tq/0")
    )
    assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_MESSAGE
    assert messages(tq, "unknown", "refused") == 1
    assert value(tq, "parkway_errors_total", code="invalid_message") == 1
    run = Run(rollout_id="g_g0", attempt=0, group_id="g", env="counter", prompt="p")
    assert isinstance(await client.request("tq/0", run, correlation_id="r-1"), Error)  # not TQ's message
    assert messages(tq, "Run", "refused") == 1
    assert value(tq, "parkway_errors_total", code="invalid_message") == 2


async def test_a_handler_error_counts_as_an_error_reply(tq: Actor, client: Client) -> None:
    commit = Commit(checkpoint_id="ck-0", deadline=soon(), location="tmp_ck-0")  # no Prepare before it
    reply = await client.request("tq/0", commit)
    assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_PHASE
    assert messages(tq, "Commit", "error") == 1 and messages(tq, "Commit", "handled") == 0
    assert value(tq, "parkway_errors_total", code="invalid_phase") == 1


async def test_a_checkpoint_cycle_records_each_phase(tq: Actor, client: Client) -> None:
    def phases(phase: str) -> float:
        return value(tq, "parkway_phase_seconds_count", phase=phase)

    assert [phases(p) for p in ("preparing", "prepared", "committed")] == [0, 0, 0]
    assert isinstance(await client.request("tq/0", Prepare(checkpoint_id="ck-1", deadline=soon())), Prepared)
    assert phases("preparing") == 1 and phases("prepared") == 0  # still prepared: not observed yet
    committed = await client.request(
        "tq/0", Commit(checkpoint_id="ck-1", deadline=soon(), location="tmp_ck-1")
    )
    assert isinstance(committed, Committed)
    assert await client.request("tq/0", Resume(checkpoint_id="ck-1", deadline=soon())) == Ok(detail="resumed")
    assert [phases(p) for p in ("preparing", "prepared", "committed")] == [1, 1, 1]
    assert value(tq, "parkway_phase_seconds_sum", phase="committed") > 0
    assert phases("idle") == 0  # idle is not a checkpoint phase: never timed


async def test_an_agent_reports_its_rollouts_in_flight(broker: MemoryBroker, client: Client) -> None:
    # The policy's queue exists but nobody answers: the rollout stays in flight at its first model call.
    # (No resources queue: releasing its tool session at the end fails at once, as unroutable.)
    await broker.declare("policy/0")
    agent = Agent(broker, secret=SECRET, replica=0)
    await agent.start()
    try:
        assert value(agent, "parkway_rollouts_in_flight") == 0
        run = Run(rollout_id="g_g0", attempt=0, group_id="g", env="counter", prompt="p", max_turns=2)
        await client.send("agent/0", run, correlation_id="g_g0-a0")
        await until(lambda: value(agent, "parkway_rollouts_in_flight") == 1)
        retire = Retire(
            checkpoint_id="ret-1", deadline=soon(), attempts=(AttemptRef(rollout_id="g_g0", attempt=0),)
        )
        assert isinstance(await client.request("agent/0", retire), Ok)
        assert value(agent, "parkway_rollouts_in_flight") == 0
    finally:
        await agent.stop()


async def test_a_snapshot_records_its_pause_and_steps(tmp_path: Path) -> None:
    config = from_dict(
        {
            "run": "met",
            "seed": 3,
            "policy": {"host": "inline", "per_token_delay_s": 0.0003},
            "tasks": {"builtin": "bank", "limit": 3},
            "rollout": {"group_size": 3, "max_turns": 6},
            "snapshot_interval_s": 0.05,
        }
    )
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        actors = [*embedded_actors(broker, SECRET, config, tmp_path), Controller(broker, secret=SECRET)]
        controller = actors[-1]
        assert isinstance(controller, Controller)
        for actor in actors:
            await actor.start()
        try:
            assert value(controller, "parkway_snapshot_pause_seconds_count") == 0
            summary = await controller.run_workload(
                config, load_tasks(config.tasks), snapshot_root=tmp_path / "snapshots"
            )
        finally:
            for actor in reversed(actors):
                await actor.stop()
    assert controller.snapshots is not None
    published = summary.snapshots_published
    assert published >= 1
    assert value(controller, "parkway_snapshots_total", outcome="published") == published
    assert value(controller, "parkway_snapshots_total", outcome="failed") == summary.snapshots_failed
    assert value(controller, "parkway_snapshots_total", outcome="skipped") == summary.snapshots_skipped
    pauses = controller.snapshots.metrics.pause_ms
    assert value(controller, "parkway_snapshot_pause_seconds_count") == len(pauses) >= published
    assert value(controller, "parkway_snapshot_pause_seconds_sum") == pytest.approx(sum(pauses) / 1000)
    assert value(controller, "parkway_snapshot_phase_seconds_count", step="commit") >= published
    [tq] = [a for a in actors if a.role == "tq"]
    assert value(tq, "parkway_phase_seconds_count", phase="committed") >= published


async def test_the_newest_snapshots_age_and_the_last_failure_are_gauges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARKWAY_FAULTS", "commit_write:agent=ENOSPC@2+")  # a disk full after one snapshot
    config = from_dict(
        {
            "run": "metfail",
            "seed": 3,
            "policy": {"host": "inline", "per_token_delay_s": 0.002},
            "tasks": {"builtin": "bank", "limit": 3},
            "rollout": {"group_size": 3, "max_turns": 6},
            "snapshot_interval_s": 0.05,
            "snapshots": {"backoff_max_s": 0.1},
        }
    )
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        actors = [*embedded_actors(broker, SECRET, config, tmp_path), Controller(broker, secret=SECRET)]
        controller = actors[-1]
        assert isinstance(controller, Controller)
        for actor in actors:
            await actor.start()
        try:
            summary = await controller.run_workload(
                config, load_tasks(config.tasks), snapshot_root=tmp_path / "snapshots"
            )
            health = controller.status_fields()["snapshots"]
        finally:
            for actor in reversed(actors):
                await actor.stop()
    assert summary.snapshots_published == 1 and summary.snapshots_failed >= 2
    assert summary.rollouts_sealed == summary.rollouts_expected
    assert health.newest_snapshot == "snapshot_1" and health.consecutive_failures == summary.snapshots_failed
    assert health.last_failure_step == "persist" and "No space left on device" in health.last_failure_reason
    assert value(controller, "parkway_snapshot_consecutive_failures") == summary.snapshots_failed
    assert value(controller, "parkway_snapshot_last_failure_timestamp_seconds") == health.last_failure_at
    age = value(controller, "parkway_snapshot_age_seconds")  # read now: since snapshot_1's created_at
    assert math.isfinite(age) and age > 0


async def test_one_endpoint_serves_every_actor_of_a_process(broker: MemoryBroker, tmp_path: Path) -> None:
    actors = [TransferQueue(broker, secret=SECRET, replica=i) for i in range(2)]
    registry = process_registry(actors, broker)
    with MetricsEndpoint(registry, 0, addr="127.0.0.1") as endpoint:
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE parkway_errors_total counter") == 1  # one family, samples of both actors
    replicas = {s.labels["replica"] for s in families["parkway_errors"].samples}
    assert replicas == {"0", "1"}
    [reconnects] = families["parkway_broker_reconnects"].samples
    assert reconnects.value == 0  # the in-memory broker never reconnects
    assert_released(endpoint.port)


async def test_serve_with_a_metrics_port_serves_while_running_and_releases_it(
    broker: MemoryBroker, client: Client
) -> None:
    port = free_port()
    tq = TransferQueue(broker, secret=SECRET, replica=0)
    scraped: list[str] = []

    async def scrape() -> None:
        await client.request("tq/0", Probe(checkpoint_id="p-2", deadline=soon()))
        url = f"http://127.0.0.1:{port}/metrics"
        scraped.append(
            await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        )

    await serve(broker, [tq], duration_s=0, on_started=scrape, metrics_port=port)
    samples = [s for f in text_string_to_metric_families(scraped[0]) for s in f.samples]
    assert any(
        s.name == "parkway_messages_total" and s.labels["type"] == "Probe" and s.value == 1 for s in samples
    )
    assert_released(port)


async def test_a_workload_serves_its_metrics_while_it_runs(tmp_path: Path) -> None:
    port = free_port()
    scraped: list[str] = []

    class Scraping(ExampleTrainer):
        def train(self, batch: list[GroupResult]) -> TrainStep:  # mid-run, on the controller's loop
            url = f"http://127.0.0.1:{port}/metrics"
            scraped.append(urllib.request.urlopen(url, timeout=5).read().decode())
            return super().train(batch)

    config = from_dict({"run": "wlm", "seed": 1, "policy": {"host": "inline"}, "tasks": {"limit": 2}})
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        summary = await run_workload(
            broker,
            SECRET,
            config,
            load_tasks(config.tasks),
            embedded=True,
            state_root=tmp_path,
            trainer=Scraping(),
            snapshots=False,
            metrics_port=port,
        )
    assert summary.train_steps == len(scraped) >= 1
    families = {f.name: f for f in text_string_to_metric_families(scraped[0])}
    roles = {s.labels["role"] for s in families["parkway_messages"].samples}
    assert roles == {"controller", "agent", "policy", "resources", "tq"}
    assert_released(port)


def test_the_metrics_port_comes_from_the_environment_or_the_flag(monkeypatch) -> None:
    monkeypatch.delenv("PARKWAY_METRICS_PORT", raising=False)
    assert RunSettings.from_env().metrics_port == 0
    monkeypatch.setenv("PARKWAY_METRICS_PORT", "9464")
    assert RunSettings.from_env().metrics_port == 9464
    assert RunSettings.from_env(metrics_port=0).metrics_port == 0  # the flag wins
    monkeypatch.setenv("PARKWAY_METRICS_PORT", "ninety")
    with pytest.raises(SettingsError, match="PARKWAY_METRICS_PORT"):
        RunSettings.from_env()
