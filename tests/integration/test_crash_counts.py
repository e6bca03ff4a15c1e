"""What a crash cost, counted: the whole cluster (every actor its own process on the real RabbitMQ)
killed with SIGKILL right after a snapshot published, restarted and restored. The summary's
generation counters must add up against the policy's own records of both its processes (its history
and its generation records), and what the sealed rollouts kept must equal an uncrashed run's."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from pathlib import Path

import pytest
import yaml
from parkway.actors.runtime.history import history_dir, read_file
from parkway.protocol import layout
from parkway.protocol.history import GenerationFinished, GenerationStarted

from tests.support.crash_cluster import CONFIG, ROLES, start_driver
from tests.support.embedded import embedded_run
from tests.support.processes import wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


async def start_cluster(spawn, client, config_path: Path) -> list:
    actors = [
        spawn(role, replica, args=("--config", str(config_path)), PARKWAY_HISTORY="1")
        for role, replica in ROLES
    ]
    for actor in actors:
        await wait_ready(client, actor, timeout=60)
    return actors


def policy_history(state: Path, run: str) -> tuple[Counter[tuple[str, int]], Counter[tuple[str, int]]]:
    """(rollout, turn) -> how often the policy's processes started and finished generating it."""
    started: Counter[tuple[str, int]] = Counter()
    finished: Counter[tuple[str, int]] = Counter()
    files = sorted(history_dir(state, run).glob("policy-0-*.jsonl"))
    assert len(files) == 2, files  # the process that was killed, and the one that finished the run
    for path in files:
        for record in read_file(path):
            if isinstance(record, GenerationStarted):
                started[(record.rollout_id, record.call_index)] += 1
            elif isinstance(record, GenerationFinished):
                finished[(record.rollout_id, record.call_index)] += 1
    return started, finished


async def test_the_summary_counts_what_a_crash_threw_away(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG)
    state = tmp_path / "state"
    data = yaml.safe_load(CONFIG)
    uncrashed = await embedded_run(data, tmp_path / "reference")

    first = await start_cluster(spawn, client, config_path)
    driver = start_driver(config_path, run_name, state, amqp_url, faults="after_publish@2")
    _, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == -signal.SIGKILL, err[-3000:]
    for actor in first:
        actor.kill()

    await start_cluster(spawn, client, config_path)
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_sealed"] == 6

    started, finished = policy_history(state, run_name)
    # Every generation either policy process finished is counted (a kill may land between the engine's
    # answer and the history line, so a counted one may lack its line, never the reverse).
    generations = summary.get("generations_total", summary["model_calls"])
    assert sum(finished.values()) <= generations <= sum(started.values()), (
        f"the summary counts {generations} generations; the policy's history: "
        f"{sum(finished.values())} finished, {sum(started.values())} started"
    )
    # The policy's generation records: one line per generation, in both processes.
    lines = (
        (state / layout.ACTOR_STATE_DIR / run_name / "policy" / "0" / layout.POLICY_GENERATIONS_FILE)
        .read_text()
        .splitlines()
    )
    # One line per generation; a "-<rollout>" line records a Forget, a "#totals" line a compaction.
    lines = [line for line in lines if not line.startswith(("-", "#"))]
    records = Counter(tuple(line.split(" ")) for line in lines)
    assert summary["generations_total"] == len(lines)
    assert summary["generations_regenerated"] == len(lines) - len(records)
    # What was kept is what a run that never crashed generated; the rest, regenerated or thrown away.
    assert (
        summary["turns_kept"] == uncrashed.turns_kept == uncrashed.generations_total == uncrashed.model_calls
    )
    assert summary["generations_discarded"] >= 0
    assert (
        summary["generations_total"]
        == summary["turns_kept"] + summary["generations_regenerated"] + summary["generations_discarded"]
    )
    # Turns generated more than once in the history are regenerations the summary counts.
    assert summary["generations_regenerated"] >= sum(n - 1 for n in finished.values() if n > 1)
    # This session's model calls are its own process's; the run's generations include the dead one's.
    assert summary["model_calls"] < summary["generations_total"]
    assert summary["replayed_from_cache"] >= 0 and summary["session"] == "continued"
