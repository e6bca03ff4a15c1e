"""A black-box agent across a real crash: ``examples/openai-agent/agent.py`` (the ``openai`` SDK, and
``urllib`` or the ``mcp`` package's client for the tools: nothing of parkway) run per attempt by
``agent: command``, every actor its own process on the real RabbitMQ.

The controller is SIGKILLed right after publishing the first snapshot that holds finished model calls;
the test SIGKILLs every other process, the agent programs with them. The restarted cluster restores the snapshot: each restored
rollout's program starts again from the beginning and the gateway answers it from the saved transcript
until it runs out. From the engine's own record the test checks that no model call the snapshot had
finished was generated again; from the run: every rollout sealed once, each bank mutation applied
once, transcripts equal to an uncrashed run's.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from parkway.actors.runtime.packs import read_records
from parkway.protocol.ids import parse_capture_key, parse_staging_key
from parkway.protocol.transcript import SavedRollout

from tests.support.crash_cluster import CRASH_FAULTS, cluster, crash_at, reference_digest, start_driver

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]
pytest.importorskip("openai")

AGENT = Path(__file__).resolve().parents[2] / "examples" / "openai-agent" / "agent.py"
CONFIG = """
run: blackbox
seed: 21
agent: command
command: {{argv: [{python}, {agent}], env: {{AGENT_STREAM: "{stream}", AGENT_TOOLS: {tools}}}}}
rollout: {{group_size: 3, max_turns: 5}}
tasks: {{builtin: bank, limit: 2}}
policy: {{host: inline, per_token_delay_s: 0.004{record}}}
topology: {{agents: 2, resources: 2}}
trainer: {{batch_groups: 1}}
snapshot_interval_s: 0.3
prepare_timeout_s: 10
"""


def config(stream: bool, record: Path | None = None) -> str:
    """Plain calls with the tools over HTTP, or streamed calls with the tools over MCP."""
    return CONFIG.format(
        python=sys.executable,
        agent=AGENT,
        stream="1" if stream else "0",
        tools="mcp" if stream else "http",
        record=f", engine_record: {record}" if record else "",
    )


def saved_model_calls(snapshot: Path) -> dict[str, tuple[int, int]]:
    """Per rollout the snapshot holds: (its saved attempt, the model calls its transcript finished)."""
    found = {}
    for path in snapshot.glob("participants/agent/*/rollouts.msgpack"):
        for saved in read_records(path, SavedRollout):
            found[saved.run.rollout_id] = (saved.run.attempt, len(saved.model))
    return found


@pytest.mark.parametrize("stream", [False, True], ids=["plain-http", "stream-mcp"])
async def test_a_black_box_agent_continues_after_the_whole_cluster_is_killed(
    spawn, client, amqp_url, run_name, tmp_path, stream
) -> None:
    if stream:
        pytest.importorskip("mcp")
    record = tmp_path / "engine.jsonl"
    reference_config = tmp_path / "reference.yaml"
    reference_config.write_text(config(stream))
    reference = await reference_digest(reference_config, tmp_path)
    config_path = tmp_path / "run.yaml"
    config_path.write_text(config(stream, record))
    state = tmp_path / "state"

    first = await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url, faults=CRASH_FAULTS)
    snapshot = await asyncio.wait_for(
        asyncio.to_thread(
            crash_at,
            driver,
            state / "snapshots" / run_name,
            lambda path: sum(calls for _, calls in saved_model_calls(path).values()) > 0,
            "a live rollout's finished model calls",
        ),
        timeout=240,
    )
    for actor in first:
        actor.kill()
    saved = saved_model_calls(snapshot)
    assert sum(calls for _, calls in saved.values()) > 0, "the snapshot must hold finished model calls"

    await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(saved)
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert summary["mean_reward"] == 1.0  # each bank session's balances replay exactly: no double transfer
    assert summary["sessions_leaked"] == 0 and summary["tool_mutations_duplicated"] == 0
    assert summary["transcripts_sha256"] == reference  # the same conversation as a run never crashed

    # Counted at the engine: in the restored timeline (the attempts after the saved ones) no call the
    # snapshot had finished was generated again; the calls after it were.
    regenerated, generated = [], 0
    for line in (json.loads(text) for text in record.read_text().splitlines()):
        capture, call_index = parse_staging_key(str(line["request_id"]))
        rollout_id, attempt = parse_capture_key(capture)
        saved_attempt, finished = saved.get(rollout_id, (-1, 0))
        if attempt > saved_attempt:
            generated += 1
            if call_index < finished:
                regenerated.append(line["request_id"])
    assert regenerated == [], f"finished model calls generated again: {regenerated}"
    assert generated > 0 and summary["model_calls"] == generated
