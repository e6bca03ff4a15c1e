"""A finished run started again against the same live actor processes, on the real RabbitMQ: the new
session starts afresh under new ids and does the work for real; nothing replayed from the actors'
caches is counted as generated, and the summary counts this session only."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from parkway.protocol.messages import Status, StatusReport

from tests.support.processes import actor_env, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

CONFIG = """
run: again
seed: 11
rollout: {group_size: 2, max_turns: 3}
tasks: {builtin: mixed, limit: 3}
policy: {engine: deterministic, host: inline, per_token_delay_s: 0.01}
topology: {agents: 2, resources: 2}
trainer: {batch_groups: 1}
snapshot_interval_s: 0.3
"""
EXPECTED = 3 * 2


def drive(config: Path, run_name: str, state: Path, amqp_url: str, **env: str) -> tuple[dict[str, Any], str]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "parkway.actors",
            "run",
            "--config",
            str(config),
            "--broker",
            amqp_url,
            "--json",
        ],
        env=actor_env(run_name, state, **env),
        capture_output=True,
        text=True,
        timeout=180,
    )
    if env.get("PARKWAY_FAULTS"):  # the controller kills itself at the fault point
        assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
        return {}, result.stderr
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout), result.stderr


ROLES = [("tq", 0), ("policy", 0), ("resources", 0), ("resources", 1), ("agent", 0), ("agent", 1)]


async def live_cluster(spawn, client, config: Path) -> None:
    for actor in [spawn(role, replica, args=("--config", str(config))) for role, replica in ROLES]:
        await wait_ready(client, actor, timeout=60)


async def test_a_finished_run_started_again_on_live_actors_starts_afresh(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    await live_cluster(spawn, client, config)
    state = tmp_path / "state"

    first, _ = await asyncio.to_thread(drive, config, run_name, state, amqp_url)
    assert first["rollouts_sealed"] == EXPECTED

    second, log = await asyncio.to_thread(drive, config, run_name, state, amqp_url)
    # This session's work only: each rollout once, not the first session's again.
    assert sum(second["rollouts_by_agent"].values()) == EXPECTED, second["rollouts_by_agent"]
    # Done for real, not answered from the actors' caches: the same seeds, the same work.
    assert second["model_calls"] == second["turns_generated"] == first["model_calls"] > 0
    assert second["generations_total"] == first["generations_total"] == first["model_calls"]
    assert second["rollouts_sealed"] == EXPECTED and second["rollouts_failed"] == 0
    # It says which: in the summary and in a log line.
    assert first["session"] == "new" and second["session"] == "afresh"
    assert first["replayed_from_cache"] == second["replayed_from_cache"] == 0, second
    assert '"event":"session_afresh"' in log.replace(" ", ""), log[-3000:]

    # The policy process's own counters: every call of both sessions generated, none replayed.
    reply = await client.request(
        "policy/0", Status(checkpoint_id=f"t-{time.monotonic_ns()}", deadline=time.time() + 10)
    )
    assert isinstance(reply, StatusReport)
    assert reply.counts["model_calls"] == 2 * first["model_calls"]
    assert reply.counts.get("replayed", 0) == 0


async def test_a_run_restored_once_then_started_again_starts_afresh(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    # The first session's controller dies after its first snapshot and the next one restores it, so
    # the live agents have seen a later controller epoch than a fresh start's; the third session must
    # still get its rollouts run, not refused as stale.
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    await live_cluster(spawn, client, config)
    state = tmp_path / "state"
    await asyncio.to_thread(drive, config, run_name, state, amqp_url, PARKWAY_FAULTS="after_publish@1")
    restored, _ = await asyncio.to_thread(drive, config, run_name, state, amqp_url)
    assert restored["session"] == "continued" and restored["restores"] == 1
    assert restored["rollouts_sealed"] == EXPECTED

    again, _ = await asyncio.to_thread(drive, config, run_name, state, amqp_url)
    assert again["session"] == "afresh" and again["restores"] == 0
    assert again["rollouts_sealed"] == EXPECTED and sum(again["rollouts_by_agent"].values()) == EXPECTED
    assert again["replayed_from_cache"] == 0 and again["model_calls"] == again["turns_kept"] > 0
