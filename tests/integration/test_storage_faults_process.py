"""A disk that fills up under a snapshot, with every actor its own process on the real RabbitMQ.

The resources process's write of its cut fails with ENOSPC at the second snapshot (``PARKWAY_FAULTS``,
half-way through the file, at the real write call, at Persist: after the window). The controller (``parkway run``) aborts that
snapshot under its checkpoint id, and is SIGKILLed right after (fault point ``after_abort``). On disk:
the first snapshot, nothing of the second; every participant logged the Abort of that id; the
resources process is the same one, alive. A restarted controller restores the first snapshot and the
run completes with the transcripts of a run that never failed.
"""

from __future__ import annotations

import json
import signal

import pytest

from tests.support.embedded import embedded_digest
from tests.support.processes import run_driver, status_of, wait_ready
from tests.support.storage_run import CONFIG, json_lines

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


async def test_a_participant_whose_disk_fills_aborts_the_snapshot_and_the_one_before_stays(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    state = tmp_path / "state"
    args = ("--config", str(config))
    actors = {
        "tq/0": spawn("tq", 0, args=args),
        "policy/0": spawn("policy", 0, args=args),
        "resources/0": spawn("resources", 0, args=args, PARKWAY_FAULTS="commit_write:resources=ENOSPC@2"),
        "agent/0": spawn("agent", 0, args=args),
    }
    for actor in actors.values():
        await wait_ready(client, actor, timeout=60)
    pids = {address: actor.pid for address, actor in actors.items()}

    code, _, err = await run_driver(config, run_name, state, amqp_url, faults="after_abort@1")
    assert code == -signal.SIGKILL, err[-3000:]
    [aborted] = [e for e in json_lines(err) if e.get("event") == "snapshot_aborted"]
    cid = aborted["checkpoint_id"]
    assert aborted["step"] == "persist" and "No space left on device" in aborted["detail"], aborted
    assert "resources/0" in aborted["detail"] and aborted["transient"] is True

    run_dir = state / "snapshots" / run_name
    assert sorted(p.name for p in run_dir.iterdir()) == ["snapshot_1"]  # no tmp_<cid>: deleted
    first = json.loads((run_dir / "snapshot_1" / "manifest.json").read_text())
    assert first["checkpoint_id"] != cid and first["episodes"], (
        "the first snapshot must catch rollouts mid-flight"
    )

    for address, actor in actors.items():  # each heard the Abort under the same id, and lives on
        lines = json_lines(actor.log_text())
        assert any(e.get("event") == "aborted" and e.get("checkpoint_id") == cid for e in lines), address
        assert (await status_of(client, address)).pid == pids[address]
    failed = [e for e in json_lines(actors["resources/0"].log_text()) if e.get("event") == "persist_failed"]
    assert [(e["checkpoint_id"], e["errno"]) for e in failed] == [(cid, "ENOSPC")]

    code, out, err = await run_driver(config, run_name, state, amqp_url)
    assert code == 0, err[-3000:]
    started = [e for e in json_lines(err) if e.get("event") == "restore_started"]
    assert [(e["snapshot"], e["saved_checkpoint"]) for e in started] == [
        ("snapshot_1", first["checkpoint_id"])
    ]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(first["episodes"])
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert summary["transcripts_sha256"] == await embedded_digest(config, tmp_path / "reference")
