"""``parkway snapshots`` on what a real cluster left on disk: every actor its own process on the real
RabbitMQ, killed with SIGKILL right after its second snapshot published. The listing says what a
restore would start from, ``verify`` names the damage done to the newest snapshot, and the restarted
cluster then restores exactly the snapshot the listing named."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import parkway
from tests.support.crash_cluster import CONFIG, ROLES  # the same cluster and workload
from tests.support.processes import run_driver, run_variables, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


async def cluster(spawn, client, config: Path) -> list[Any]:
    actors = [spawn(role, replica, args=("--config", str(config))) for role, replica in ROLES]
    for actor in actors:
        await wait_ready(client, actor, timeout=60)
    return actors


async def test_the_cli_reads_what_a_killed_cluster_left(spawn, client, amqp_url, run_name, tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    state = tmp_path / "state"  # where the spawned actors write their records, and the driver its manifests

    first = await cluster(spawn, client, config)
    code, _, err = await run_driver(config, run_name, state, amqp_url, faults="after_publish@2")
    assert code == -signal.SIGKILL, err[-3000:]
    for actor in first:
        actor.kill()
    run_dir = state / "snapshots" / run_name
    manifests = {
        p.name: json.loads((p / "manifest.json").read_text()) for p in sorted(run_dir.glob("snapshot_*"))
    }
    assert list(manifests) == ["snapshot_1", "snapshot_2"]

    # What is on disk, as the manifests say, and the newest is what a restore starts from.
    listed = parkway("snapshots", "list", "--config", str(config), "--json", **run_variables(run_name, state))
    assert listed.returncode == 0, listed.stderr
    inventory = json.loads(listed.stdout)
    assert inventory["run"] == run_name and inventory["completed"] is False
    for row in inventory["snapshots"]:
        manifest = manifests[row["name"]]
        assert row["checkpoint_id"] == manifest["checkpoint_id"]
        assert row["rollouts_saved"] == len(manifest["episodes"])
        assert row["trainer_step"] == manifest["trainer"]["step"]
        assert row["verifies"] is True
    assert inventory["restore"]["snapshot"] == "snapshot_2"
    assert manifests["snapshot_2"]["episodes"], "the snapshot must catch rollouts mid-flight"

    table = parkway("snapshots", "list", **run_variables(run_name, state))
    assert table.returncode == 0, table.stderr
    newest = next(line for line in table.stdout.splitlines() if " snapshot_2 " in f" {line} ")
    assert newest.split()[:5] == [
        "*",
        "snapshot_2",
        manifests["snapshot_2"]["checkpoint_id"],
        str(manifests["snapshot_2"]["trainer"]["step"]),
        str(len(manifests["snapshot_2"]["episodes"])),
    ]

    verified = parkway("snapshots", "verify", **run_variables(run_name, state))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.splitlines()[-1] == "2 of 2 snapshot(s) verify"

    # Flip one bit of an agent's saved transcripts in the newest snapshot.
    damaged = run_dir / "snapshot_2" / "participants" / "agent" / "0" / "rollouts.msgpack"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 3] ^= 0x10
    damaged.write_bytes(bytes(data))
    [listed_digest] = [
        e["sha256"]
        for e in manifests["snapshot_2"]["files"]
        if e["path"] == "participants/agent/0/rollouts.msgpack"
    ]
    bad = parkway("snapshots", "verify", **run_variables(run_name, state))
    assert bad.returncode == 1
    assert bad.stdout.splitlines()[1:] == [
        "snapshot_2: participants/agent/0/rollouts.msgpack does not match its sha256: the manifest says "
        f"{listed_digest[:16]}, the file hashes to {hashlib.sha256(data).hexdigest()[:16]}",
        "1 of 2 snapshot(s) verify; 1 do not",
    ]
    inventory = json.loads(
        parkway(
            "snapshots", "list", "--config", str(config), "--json", **run_variables(run_name, state)
        ).stdout
    )
    predicted = inventory["restore"]["snapshot"]
    assert predicted == "snapshot_1"

    # The restarted cluster restores exactly what the listing predicted.
    await cluster(spawn, client, config)
    code, out, err = await run_driver(config, run_name, state, amqp_url)
    assert code == 0, err[-3000:]
    started = [json.loads(line) for line in err.splitlines() if '"restore_started"' in line]
    assert [(e["snapshot"], e["saved_checkpoint"]) for e in started] == [
        (predicted, manifests[predicted]["checkpoint_id"])
    ]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(manifests[predicted]["episodes"])

    after = json.loads(parkway("snapshots", "list", "--json", **run_variables(run_name, state)).stdout)
    assert after["completed"] is True and after["restore"]["snapshot"] is None
