"""Long runs and many runs on the same live actors, on the real RabbitMQ (issue 22; docs/memory.md).

Every role is its own ``parkway actor`` process; ``parkway run`` drives them with a fast engine (the
deterministic one, no token delay, two turns) and a snapshot about every second. The first run seals
several thousand rollouts while the test reads every actor's ``Status`` (``structures``): each
per-rollout structure stays bounded by the rollouts in flight (a small multiple of them, plus the
fixed fence of forgotten ids), far below the rollouts served. Then two more runs on the same actors:
each seals every rollout and its summary counts its own work, exactly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.launch.processes import status_of
from parkway.protocol.messages import StatusReport

from tests.support.processes import run_driver, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

IN_FLIGHT = 24
GROUP = 10
LONG_TASKS = int(os.environ.get("PARKWAY_LONG_RUN_TASKS", "300"))  # x GROUP rollouts
SHORT_TASKS = 8
FENCE = 64  # forgotten ids a participant keeps as a fence (PARKWAY_FORGET_FENCE)
# Rollouts a participant holds: those in flight, the refs the controller batches until as many wait as
# are in flight, one such batch on its way, and what ends while a checkpoint holds a Forget back (no
# more than are in flight); plus the fence. Per-turn structures hold max_turns entries a rollout.
BOUND = 4 * IN_FLIGHT + FENCE
MAX_TURNS = 2
BATCH = 4  # groups a train step takes
UNTRAINED = 8  # trainer.max_untrained_groups: sealed groups not yet trained that hold admission back
# TQ keeps a rollout's rows from its first turn until the trainer consumed its group, so its bound is
# the trainer's backpressure (docs/memory.md), not the rollouts in flight: the groups still generating
# (the rollouts not ended, in flight or admitted and waiting, fewer than IN_FLIGHT + GROUP, span at most
# that many groups' worth plus one), the untrained ones below the bound when admission last let groups
# in, and a trained batch whose ReleaseRows is on its way.
GENERATING_GROUPS = (IN_FLIGHT + GROUP) // GROUP + 2
TQ_ROLLOUTS = (GENERATING_GROUPS + UNTRAINED + BATCH) * GROUP
TQ_ROWS = {"canonical", "staging", "staging_keys"}  # per rollout (one attempt each: no failures here)
PER_TURN = {"generation_turns"}  # the policy's turns counted: max_turns entries a rollout
# Caches of a fixed capacity (the runtime's reply cache, its journal, the requests it answered): bounded
# by their capacity, not per rollout; they are checked against it, not against the rollouts in flight.
FIXED = {
    "reply_cache": 4096,
    "reply_cache_bytes": 16 << 20,
    "answered_requests": 10_000,
    "reply_journal_records": 10**9,
    "reply_journal_bytes": 10**12,
}

ROLES = [("tq", 0), ("policy", 0), ("resources", 0), ("resources", 1), ("agent", 0), ("agent", 1)]
# Read while the first run goes: the actors, and the driver's controller (it answers Status too).
SAMPLED = [*(f"{r}/{i}" for r, i in ROLES), "controller/0"]


def config_text(tasks: Path) -> str:
    return f"""
run: long
seed: 7
rollout: {{group_size: {GROUP}, max_turns: {MAX_TURNS}, max_in_flight: {IN_FLIGHT}}}
tasks: {{path: {tasks}}}
policy: {{engine: deterministic, host: inline, per_token_delay_s: 0.0}}
topology: {{agents: 2, resources: 2}}
trainer: {{batch_groups: {BATCH}, max_untrained_groups: {UNTRAINED}}}
snapshot_interval_s: 1.0
"""


def write_config(directory: Path, name: str, tasks: int) -> Path:
    lines = [
        json.dumps(
            {"env": "counter", "prompt": f"Raise the counter and report it ({n}).", "max_turns": MAX_TURNS}
        )
        for n in range(tasks)
    ]
    path = directory / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = directory / f"{name}.yaml"
    config.write_text(config_text(path))
    return config


def limit_of(address: str, name: str) -> int:
    """The most entries ``name`` of ``address`` may hold at any time of the long run."""
    if address.startswith("tq/") and name == "lineage":  # (rollout, turn)
        return MAX_TURNS * TQ_ROLLOUTS
    if address.startswith("tq/") and name in TQ_ROWS:
        return TQ_ROLLOUTS
    if name in PER_TURN:
        return MAX_TURNS * 4 * IN_FLIGHT
    return BOUND


async def sample(client: Any, samples: dict[str, list[StatusReport]], stop: asyncio.Event) -> None:
    """Every actor's Status, about every second, until ``stop``."""
    while not stop.is_set():
        for address in SAMPLED:
            try:
                samples[address].append(await status_of(client, address))
            except Exception:  # busy past its deadline: the next round asks again
                continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def drive(config: Path, run_name: str, state: Path, amqp_url: str) -> dict[str, Any]:
    code, out, err = await run_driver(config, run_name, state, amqp_url)
    assert code == 0, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    return json.loads(out)


def check_own_counts(summary: dict[str, Any], expected: int, session: str) -> None:
    """A run of ``expected`` rollouts that failed none: every count is this run's own."""
    assert summary["session"] == session, summary["session"]
    assert summary["rollouts_expected"] == summary["rollouts_sealed"] == expected, summary
    assert summary["rollouts_failed"] == 0 and summary["attempts_failed"] == 0, summary
    # Each rollout run once, by this run: not redone because an actor still held an old session.
    assert summary["attempts_dispatched"] == expected, summary
    assert sum(summary["rollouts_by_agent"].values()) == expected, summary["rollouts_by_agent"]
    assert summary["receipts_stale"] == 0 and summary["replayed_from_cache"] == 0, summary
    # Generated in this run, each turn once (never an earlier run's added in, nothing redone).
    assert summary["model_calls"] == summary["turns_generated"] == summary["turns_kept"] >= expected
    assert summary["generations_regenerated"] == summary["generations_discarded"] == 0, summary
    assert summary["sessions_leaked"] == 0 and summary["tool_mutations_duplicated"] == 0, summary
    assert summary["train_steps"] == expected // GROUP // 4 + (1 if (expected // GROUP) % 4 else 0)


async def test_thousands_of_rollouts_keep_state_bounded_and_three_runs_each_count_their_own(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    long_config = write_config(tmp_path, "long", LONG_TASKS)
    short_config = write_config(tmp_path, "short", SHORT_TASKS)
    for actor in [
        spawn(role, replica, args=("--config", str(long_config)), PARKWAY_FORGET_FENCE=str(FENCE))
        for role, replica in ROLES
    ]:
        await wait_ready(client, actor, timeout=60)
    state = tmp_path / "state"

    samples: dict[str, list[StatusReport]] = {a: [] for a in SAMPLED}
    stop = asyncio.Event()
    sampler = asyncio.get_running_loop().create_task(sample(client, samples, stop))
    started = time.monotonic()
    try:
        first = await drive(long_config, run_name, state, amqp_url)
    finally:
        stop.set()
        await sampler
    served = LONG_TASKS * GROUP
    check_own_counts(first, served, "new")
    assert first["snapshots_published"] >= 3, first["snapshots_published"]
    assert served > 4 * max(BOUND, TQ_ROLLOUTS)  # the bounds are clearly below what was served

    # After the run, once more: what the actors hold with nothing in flight.
    for role, replica in ROLES:
        samples[f"{role}/{replica}"].append(await status_of(client, f"{role}/{replica}"))
    for address, reports in samples.items():
        peaks = {n: max(r.structures.get(n, 0) for r in reports) for n in reports[-1].structures}
        print(address, "peak entries:", dict(sorted(peaks.items())))
        assert len(reports) >= 3, (address, len(reports))
        assert reports[-1].structures, f"{address} reports no structures"
        for name in {n for r in reports for n in r.structures}:
            peak = max(r.structures.get(name, 0) for r in reports)
            limit = FIXED.get(name, limit_of(address, name))
            assert peak <= limit, f"{address} {name}: {peak} entries at most, bound {limit}, {served} served"
    long_s = time.monotonic() - started

    # Two more runs on the same live actors: each seals every rollout, with counts of its own.
    second = await drive(short_config, run_name, state, amqp_url)
    check_own_counts(second, SHORT_TASKS * GROUP, "afresh")
    third = await drive(short_config, run_name, state, amqp_url)
    check_own_counts(third, SHORT_TASKS * GROUP, "afresh")
    # The same seeds, the same work: both short runs generated alike.
    assert second["model_calls"] == third["model_calls"]
    assert second["tokens_generated"] == third["tokens_generated"] > 0
    print(f"long run: {served} rollouts in {long_s:.1f} s; {first['rollouts_per_s']} rollouts/s")
