"""Receipts in the cut (docs/snapshots.md#receipts-in-the-cut) with every actor its own process on the
real RabbitMQ: TQ holds every seal it is asked for (``PARKWAY_FAULTS=tq_seal=HOLD@1+``), so each
rollout that finishes is SEALING in the controller's ledger when a snapshot is taken. The whole
cluster is SIGKILLed right after a snapshot that saved at least three such attempts, and the restore
seals each of them once, before anything runs again: nothing is generated again for them, and the run
completes with the same transcripts as one that never stopped."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from parkway.protocol.anchor import decode_ledger_file
from parkway.protocol.layout import LEDGER
from parkway.protocol.ledger import Ledger

from tests.support.crash_cluster import (
    CONFIG,
    CRASH_FAULTS,
    cluster,
    crash_at,
    reference_digest,
    start_driver,
)

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

HELD_SEALS = "tq_seal=HOLD@1+"  # TQ answers no seal: every receipt that arrives stays SEALING


def sealing_in(snapshot: Path) -> set[tuple[str, int]]:
    """The attempts a snapshot's ledger saved SEALING."""
    ledger = Ledger.load(decode_ledger_file((snapshot / LEDGER).read_bytes()).ledger)
    return {(sibling.rollout_id, attempt.index) for sibling, attempt in ledger.sealing()}


async def test_seals_on_their_way_when_the_cluster_dies_are_finished_by_the_restore(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG)
    state = tmp_path / "state"
    reference = await reference_digest(config_path, tmp_path)

    first = await cluster(spawn, client, config_path, state, env={"tq": {"PARKWAY_FAULTS": HELD_SEALS}})
    driver = start_driver(config_path, run_name, state, amqp_url, faults=CRASH_FAULTS)
    snapshot = await asyncio.to_thread(
        crash_at,
        driver,
        state / "snapshots" / run_name,
        lambda snapshot: len(sealing_in(snapshot)) >= 3,
        "three attempts SEALING",
    )
    for actor in first:  # the rest of the cluster dies with it, TQ with every seal still held
        actor.kill()
    saved = sealing_in(snapshot)
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert len(saved) >= 3
    assert not saved & {tuple(e) for e in manifest["episodes"]}  # not restored as running rollouts

    await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(manifest["episodes"])
    assert summary["seals_finished_at_restore"] == len(saved)  # each sealed by the restore, once
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert len(saved) + len(manifest["episodes"]) == 6  # every rollout: running in the cut, or SEALING
    assert summary["mean_reward"] == 1.0 and summary["tool_mutations_duplicated"] == 0
    assert summary["turns_regenerated"] <= summary["rollouts_restored"]
    assert summary["transcripts_sha256"] == reference
