"""A whole run over the real RabbitMQ with every actor in its own OS process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tests.support.embedded import embedded_digest
from tests.support.processes import actor_env, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

CONFIG = """
run: procs
seed: 5
rollout: {group_size: 2, max_turns: 4}
tasks: {builtin: mixed, limit: 4}
policy: {host: ray, engines: 2}
topology: {agents: 2, resources: 2}
trainer: {batch_groups: 2}
"""


async def test_a_full_run_with_every_actor_in_its_own_process(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG)
    with_config = ("--config", str(config_path))
    actors = [
        spawn("tq", 0),
        spawn("policy", 0, args=with_config),  # two engine actors in Ray, from the policy section
        spawn("resources", 0, args=with_config),
        spawn("resources", 1, args=with_config),
        spawn("agent", 0),
        spawn("agent", 1),
    ]
    for actor in actors:
        await wait_ready(client, actor, timeout=60)
    result = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "parkway.actors",
            "run",
            "--config",
            str(config_path),
            "--broker",
            amqp_url,
            "--json",
        ],
        env=actor_env(run_name, tmp_path / "driver"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["rollouts_expected"] == summary["rollouts_sealed"] == 8
    assert summary["model_calls"] == summary["turns_generated"] == 8 * 4
    assert summary["mean_reward"] == 1.0 and summary["train_steps"] == 2
    assert summary["rollouts_by_agent"] == {"agent/0": 4, "agent/1": 4}
    assert all(n > 0 for n in summary["tool_calls_by_resources"].values())
    # The processes really did the work: each one's own counters say so.
    pids = {a.address: a.pid for a in actors}
    assert len(set(pids.values())) == 6

    # Same seeds, same transcripts: the embedded run of the same configuration generates the same tokens.
    assert await embedded_digest(config_path, tmp_path / "embedded") == summary["transcripts_sha256"]
