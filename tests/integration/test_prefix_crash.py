"""Prefix recovery across a real crash: every actor its own process on the real RabbitMQ, the
deterministic engine bringing out long replies at a pace, ``recovery.target_level: prefix``.

The controller is SIGKILLed right after publishing the first snapshot taken while model calls generate;
the test SIGKILLs every other process at once. The restarted cluster restores that snapshot and
finishes. From the engine's own record (one line per generation, appended by the policy processes of
both timelines) the test checks that every call the snapshot kept tokens of, for a rollout it
restored, was continued: the restored timeline generated only the tokens after the cut, and never
that call from its first token. And the run: every rollout sealed once, each bank mutation applied
once, the transcripts equal to an uncrashed run's (the engine continues a reply exactly).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
from parkway.actors.engines.reaper import descendants, start_time
from parkway.actors.launch.processes import kill_all
from parkway.protocol.ids import parse_capture_key, parse_staging_key

from tests.support.crash_cluster import CRASH_FAULTS, cluster, crash_at, reference_digest, start_driver
from tests.support.processes import wait_ready
from tests.support.waiting import until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

CONFIG = """
run: prefix
seed: 21
rollout: {{group_size: 3, max_turns: 4, max_tokens: 900}}
tasks: {{builtin: bank, limit: 2}}
policy: {{host: inline, per_token_delay_s: 0.003, filler_words: 80{record}}}
topology: {{agents: 2, resources: 2}}
trainer: {{batch_groups: 1}}
recovery: {{target_level: prefix}}
snapshot_interval_s: 0.4
prepare_timeout_s: 10
"""


def engine_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def policy_record(snapshot: Path) -> dict[str, object]:
    [record] = msgspec.msgpack.decode(
        (snapshot / "participants" / "policy" / "0" / "participant.msgpack").read_bytes()
    )
    return record


def kept_prefixes(snapshot: Path) -> dict[tuple[str, int], int]:
    """(rollout, call index) -> tokens kept, for every call the snapshot caught generating in a
    rollout it restores."""
    restored = {
        rollout_id for rollout_id, _ in json.loads((snapshot / "manifest.json").read_text())["episodes"]
    }
    return {
        (p["rollout_id"], p["call_index"]): len(p["token_ids"])
        for p in policy_record(snapshot)["prefixes"]
        if p["rollout_id"] in restored
    }


def crash_when_generating(driver, run_dir: Path) -> Path:
    return crash_at(
        driver, run_dir, lambda path: bool(kept_prefixes(path)), "a restored rollout's call generating"
    )


def gone(pid: int) -> bool:
    """Ended (or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return start_time(pid) is None


def call_of(request_id: str) -> tuple[str, int, int]:
    """(rollout id, attempt, call index) of a model call's request id."""
    capture, call_index = parse_staging_key(request_id)
    rollout_id, attempt = parse_capture_key(capture)
    return rollout_id, attempt, call_index


def check_continued(
    record: Path, saved: dict[str, int], kept: dict[tuple[str, int], int], summary: dict[str, object]
) -> list[dict[str, object]]:
    """From the engine's own account of the restored timeline (the calls of the attempts the restore
    made: a new policy process may also serve the dead timeline's calls still queued before the restore
    reaches it, which are of the saved attempts and none of the run's work): every kept call was
    continued from its kept tokens, once, never generated from its first token; the summary counts the
    same. Returns the kept calls' lines."""
    restored_timeline = []
    for line in engine_lines(record):
        rollout_id, attempt, call_index = call_of(str(line["request_id"]))
        if attempt > saved.get(rollout_id, -1):
            restored_timeline.append((rollout_id, call_index, line))
    continued = []
    for key, tokens in kept.items():
        lines = [
            line for rollout_id, call_index, line in restored_timeline if (rollout_id, call_index) == key
        ]
        assert [(x["kept"], x["prefix"]) for x in lines] == [(tokens, tokens)], (
            f"{key}: not continued once from its {tokens} kept tokens: {lines}"
        )
        continued.extend(lines)
    assert summary["calls_continued"] == len(kept) and summary["prefix_fallbacks"] == 0
    assert summary["prefix_tokens_kept"] == sum(kept.values()) > 0
    # The summary counts the tokens the engine sampled for the run, never a kept one.
    assert summary["tokens_generated"] == sum(int(line["generated"]) for _, _, line in restored_timeline)
    return continued


async def test_calls_in_flight_at_the_snapshot_continue_after_the_whole_cluster_is_killed(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    record = tmp_path / "engine.jsonl"
    reference_config = tmp_path / "reference.yaml"
    reference_config.write_text(CONFIG.format(record=""))
    reference = await reference_digest(reference_config, tmp_path)
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG.format(record=f", engine_record: {record}"))
    state = tmp_path / "state"

    first = await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url, faults=CRASH_FAULTS)
    run_dir = state / "snapshots" / run_name
    snapshot = await asyncio.wait_for(asyncio.to_thread(crash_when_generating, driver, run_dir), timeout=240)
    for actor in first:
        actor.kill()
    for actor in first:
        await asyncio.to_thread(actor.wait, 30)
    manifest = json.loads((snapshot / "manifest.json").read_text())
    kept = kept_prefixes(snapshot)
    assert kept, "the snapshot must catch restored rollouts' calls generating, or this case proves nothing"

    await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(manifest["episodes"])
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert summary["mean_reward"] == 1.0  # each bank session's balances replay exactly: no double transfer
    assert summary["sessions_leaked"] == 0 and summary["tool_mutations_duplicated"] == 0
    assert summary["transcripts_sha256"] == reference  # continued replies are the uninterrupted ones

    check_continued(record, dict(manifest["episodes"]), kept, summary)


VLLM_CONFIG = """
run: prefixv
seed: 4
agent: counter
rollout: {{group_size: 4, max_turns: 3, max_tokens: 500}}  # 3 replies and the prompt within 2048
tasks: {{builtin: counter, limit: 2}}
policy: {{engine: vllm, model: {model}, host: inline, engine_record: {record}}}
topology: {{agents: 1, resources: 1}}
trainer: {{batch_groups: 1}}
recovery: {{target_level: prefix}}
snapshot_interval_s: 0.3
prepare_timeout_s: 20
"""
VLLM_ROLES = [("tq", 0), ("policy", 0), ("resources", 0), ("agent", 0)]


async def vllm_cluster(spawn, client, config_path: Path) -> list:
    """The actors, the policy with vLLM in its process (its engine takes tens of seconds to start)."""
    actors = [spawn(role, replica, args=("--config", str(config_path))) for role, replica in VLLM_ROLES]
    for actor in actors:
        await wait_ready(client, actor, timeout=240)
    return actors


async def test_vllm_calls_in_flight_at_the_snapshot_continue_after_the_whole_cluster_is_killed(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    pytest.importorskip("vllm")
    from parkway.actors.engines.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    record = tmp_path / "engine.jsonl"
    config_path = tmp_path / "run.yaml"
    config_path.write_text(VLLM_CONFIG.format(model=model, record=record))
    state = tmp_path / "state"

    first = await vllm_cluster(spawn, client, config_path)
    driver = start_driver(config_path, run_name, state, amqp_url, faults=CRASH_FAULTS)
    run_dir = state / "snapshots" / run_name
    snapshot = await asyncio.wait_for(asyncio.to_thread(crash_when_generating, driver, run_dir), timeout=300)
    [policy] = [actor for actor in first if actor.address == "policy/0"]
    engine_processes = descendants(policy.pid)  # vLLM's engine core and its worker
    assert engine_processes, "vLLM runs its engine in processes of its own"
    kill_all(first)
    # Killed with their policy process, not left holding their memory (engines/reaper.py).
    await until(lambda: all(gone(pid) for pid in engine_processes), timeout=30)
    saved = dict(json.loads((snapshot / "manifest.json").read_text())["episodes"])
    kept = kept_prefixes(snapshot)
    assert kept, "the snapshot must catch restored rollouts' calls generating, or this case proves nothing"

    await vllm_cluster(spawn, client, config_path)
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=300)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(saved)
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 8 and summary["rollouts_failed"] == 0
    assert summary["sessions_leaked"] == 0 and summary["tool_mutations_duplicated"] == 0
    for line in check_continued(record, saved, kept, summary):
        if line["generated"]:  # vLLM's own output: the prefix was in the prompt, not sampled again
            assert int(line["prompt_tokens"]) > int(line["kept"])
