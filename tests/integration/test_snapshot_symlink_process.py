"""A damaged newest snapshot is passed over by a restore over real processes, as ``verify`` fails it.

Every actor is its own process on the real RabbitMQ. The controller (``parkway run``) is SIGKILLed
right after it publishes its second snapshot (fault point ``after_publish@2``). Then
``snapshot_2/participants`` is replaced by a symlink to an identical copy outside the snapshot root:
every digest still matches through it, but nothing is read through a symlink. ``parkway snapshots
verify`` fails it, ``snapshots list`` marks ``snapshot_1``, and a restarted controller restores from
``snapshot_1`` (logging why it passed ``snapshot_2`` over) and completes the run with the transcripts
of a run that never crashed.
"""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from tests.support.cli import parkway
from tests.support.embedded import embedded_digest
from tests.support.processes import run_driver, run_variables, wait_ready
from tests.support.storage_run import CONFIG, json_lines

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


async def test_a_restore_passes_over_a_snapshot_with_a_directory_symlink(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    state = tmp_path / "state"
    args = ("--config", str(config))
    actors = [spawn(role, 0, args=args) for role in ("tq", "policy", "resources", "agent")]
    for actor in actors:
        await wait_ready(client, actor, timeout=60)

    code, _, err = await run_driver(config, run_name, state, amqp_url, faults="after_publish@2")
    assert code == -signal.SIGKILL, err[-3000:]
    run_dir = state / "snapshots" / run_name
    assert sorted(p.name for p in run_dir.glob("snapshot_*")) == ["snapshot_1", "snapshot_2"]
    first = json.loads((run_dir / "snapshot_1" / "manifest.json").read_text())

    outside = tmp_path / "outside_participants"
    shutil.copytree(run_dir / "snapshot_2" / "participants", outside)
    shutil.rmtree(run_dir / "snapshot_2" / "participants")
    (run_dir / "snapshot_2" / "participants").symlink_to(outside, target_is_directory=True)

    verify = parkway("snapshots", "verify", "--json", **run_variables(run_name, state))
    assert verify.returncode == 1, verify.stdout + verify.stderr
    verdicts = {s["name"]: s for s in json.loads(verify.stdout)["snapshots"]}
    assert verdicts["snapshot_1"]["ok"] is True
    assert [(p["file"], p["kind"]) for p in verdicts["snapshot_2"]["problems"]] == [
        ("participants", "symlink")
    ]
    listing = parkway(
        "snapshots", "list", "--json", "--config", str(config), **run_variables(run_name, state)
    )
    assert json.loads(listing.stdout)["restore"]["snapshot"] == "snapshot_1", listing.stdout

    code, out, err = await run_driver(config, run_name, state, amqp_url)
    assert code == 0, err[-3000:]
    events = json_lines(err)
    skipped = [e for e in events if e.get("event") == "snapshot_skipped"]
    assert [(e["snapshot"], e["reason"]) for e in skipped] == [
        ("snapshot_2", f"snapshot_2: participants is a symlink (to {outside})")
    ]
    started = [e for e in events if e.get("event") == "restore_started"]
    assert [(e["snapshot"], e["saved_checkpoint"]) for e in started] == [
        ("snapshot_1", first["checkpoint_id"])
    ]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(first["episodes"])
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert summary["transcripts_sha256"] == await embedded_digest(config, tmp_path / "reference")
