"""Mistakes at the command line, against actor processes on the real RabbitMQ: each gets one line on
stderr that names its cause and the exit code the README documents (2: does not validate), never a
traceback and never silence."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import parkway
from tests.support.processes import run_variables, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

# A secret no actor of the test run has: another run's, or an operator's typo.
OTHER_SECRET = "another-runs-secret-0123456789abcdef"

CONFIG = """
run: mistakes
seed: 3
rollout: {group_size: 1, max_turns: 2}
tasks: {builtin: mixed, limit: 1}
policy: {engine: deterministic, host: inline}
topology: {agents: 1, resources: 1}
trainer: {batch_groups: 1}
"""


def one_line(result: subprocess.CompletedProcess[str], *, logs: bool = False) -> str:
    """The single line a mistake prints on stderr (a traceback or several lines fail the test).
    ``logs``: the command also writes its actors' JSON log lines there (``parkway run``); they are not
    the message."""
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if logs:
        lines = [line for line in lines if not line.startswith("{")]
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


async def test_a_driver_with_another_secret_stops_at_once_naming_it(
    spawn, client, amqp_url, run_name, tmp_path: Path
) -> None:
    await wait_ready(client, spawn("tq", 0))
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    variables = run_variables(
        run_name,
        tmp_path / "driver",
        PARKWAY_SECRET=OTHER_SECRET,
        # Longer than the driver needs to recognize the refusal; before the fix it waited this out.
        PARKWAY_CLUSTER_WAIT_S="30",
    )
    result = await asyncio.to_thread(
        parkway, "run", "--config", str(config), "--broker", amqp_url, timeout=120, **variables
    )
    line = one_line(result, logs=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert line.startswith("parkway: unauthorized:") and "PARKWAY_SECRET" in line, line
    assert "tq/0" in line, line


async def test_publish_with_another_runs_secret_is_refused_in_one_line(
    spawn, client, amqp_url, run_name, tmp_path: Path
) -> None:
    await wait_ready(client, spawn("tq", 0))
    variables = run_variables(
        run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url, PARKWAY_SECRET=OTHER_SECRET
    )
    result = await asyncio.to_thread(parkway, "publish", "status", "--to", "tq/0", **variables)
    line = one_line(result)
    assert result.returncode == 2
    assert line.startswith("parkway: unauthorized:") and "does not verify" in line, line


async def test_publish_to_a_role_without_replica(amqp_url, run_name, tmp_path: Path) -> None:
    variables = run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url)
    result = await asyncio.to_thread(parkway, "publish", "status", "--to", "agent", **variables)
    line = one_line(result)
    assert result.returncode == 2
    assert line == "parkway: address 'agent' is not ROLE/REPLICA", line


async def test_publish_with_a_path_for_a_checkpoint_id(amqp_url, run_name, tmp_path: Path) -> None:
    variables = run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url)
    result = await asyncio.to_thread(
        parkway, "publish", "prepare", "--to", "agent/0", "--checkpoint-id", "../etc", **variables
    )
    line = one_line(result)
    assert result.returncode == 2
    assert line.startswith("parkway: invalid_message: checkpoint id '../etc' does not match"), line


@pytest.mark.parametrize("command", [("publish", "status", "--to", "tq/0"), ("status",), ("logs",)])
async def test_a_broker_url_of_another_scheme(command: tuple[str, ...], run_name, tmp_path: Path) -> None:
    variables = run_variables(run_name, tmp_path / "cli")
    result = await asyncio.to_thread(parkway, *command, "--broker", "http://127.0.0.1:15672/", **variables)
    line = one_line(result)
    assert result.returncode == 2
    assert line.startswith("parkway: broker: unsupported broker URL 'http://127.0.0.1:15672/'"), line


async def test_logs_without_a_broker_says_so(run_name, tmp_path: Path) -> None:
    result = await asyncio.to_thread(parkway, "logs", **run_variables(run_name, tmp_path / "cli"))
    line = one_line(result)
    assert result.returncode == 2
    assert line.startswith("parkway: logs: no broker configured"), line
    assert "PARKWAY_BROKER_URL" in line and "FILE" in line, line


@pytest.mark.parametrize(
    ("args", "variables", "refused"),
    [
        (("--nice", "-3"), {}, "--nice='-3'"),
        ((), {"PARKWAY_NICE": "ten"}, "PARKWAY_NICE='ten'"),
        (("--nice", "20"), {"PARKWAY_NICE": "5"}, "--nice='20'"),
    ],
)
async def test_an_actor_asked_to_raise_its_priority_refuses_to_start(
    args: tuple[str, ...], variables: dict[str, str], refused: str, amqp_url, run_name, tmp_path: Path
) -> None:
    settings = {
        **run_variables(run_name, tmp_path / "cli"),
        "PARKWAY_INSECURE_SHARED_SECRET": "1",
        **variables,
    }
    result = await asyncio.to_thread(parkway, "actor", "tq", "--broker", amqp_url, *args, **settings)
    line = one_line(result)
    assert result.returncode == 2
    assert line == f"parkway: {refused}: want a niceness increment, 0 to 19", line
