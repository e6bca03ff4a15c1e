"""The crash matrix: the whole cluster, every actor its own process on the real RabbitMQ, killed with
SIGKILL at a step of the save (or of a restore), then restarted.

The controller kills itself at the step (``PARKWAY_FAULTS``, a real SIGKILL at an exact point); the
test then SIGKILLs every other process at once. Every case asserts that the run completes, that no
sealed rollout is lost or duplicated, that every restored rollout continued (its finished turns were
not generated again, beyond the one model call in flight), that each tool mutation was applied exactly
once (bank balances verify), and that the transcripts equal an uncrashed run's with the same seeds.
"""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from tests.support.crash_cluster import CONFIG, ROLES, cluster, reference_digest, start_driver
from tests.support.processes import wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


@pytest.mark.parametrize(
    "fault",
    [
        "after_prepared@2",  # every agent's cut back: the snapshot never publishes, the one before is restored
        "after_commit@2",  # every cut taken, in memory only
        "after_prepare@2",  # the window over, the Prepares on their way, no cut back yet
        "after_persist@2",  # every cut written, not validated: no manifest yet, the one before stands
        "after_publish@2",  # published
    ],
)
async def test_the_whole_cluster_killed_at_a_save_step(
    spawn, client, amqp_url, run_name, tmp_path, fault
) -> None:
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG)
    state = tmp_path / "state"
    reference = await reference_digest(config_path, tmp_path)

    first = await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url, faults=fault)
    _, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == -signal.SIGKILL, f"the controller did not die at {fault}:\n{err[-3000:]}"
    for actor in first:  # the rest of the cluster dies with it
        actor.kill()
    snapshots = sorted((state / "snapshots" / run_name).glob("snapshot_*"))
    assert snapshots, "at least the first snapshot was published before the crash"
    manifest = json.loads((snapshots[-1] / "manifest.json").read_text())
    assert manifest["episodes"], "the snapshot must catch rollouts mid-flight, or this case proves nothing"

    await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(manifest["episodes"])
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert summary["mean_reward"] == 1.0  # each bank session's balances replay exactly: no double transfer
    assert summary["sessions_leaked"] == 0 and summary["tool_mutations_duplicated"] == 0
    assert summary["turns_regenerated"] <= summary["rollouts_restored"]  # only the calls in flight
    assert summary["transcripts_sha256"] == reference  # the same tokens as a run that never crashed


async def test_the_whole_cluster_killed_during_a_restore(spawn, client, amqp_url, run_name, tmp_path) -> None:
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG)
    state = tmp_path / "state"
    reference = await reference_digest(config_path, tmp_path)

    first = await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url, faults="after_publish@2")
    await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == -signal.SIGKILL
    for actor in first:
        actor.kill()

    # The restore itself dies after the agents installed their transcripts, before anything resumed.
    second = await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url, faults="after_restore_agent")
    _, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == -signal.SIGKILL, err[-3000:]
    for actor in second:
        actor.kill()

    await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] > 0  # the same snapshot, restored again
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6
    assert summary["mean_reward"] == 1.0 and summary["sessions_leaked"] == 0
    assert summary["turns_regenerated"] <= summary["rollouts_restored"]
    assert summary["transcripts_sha256"] == reference


async def test_one_agent_replica_killed_mid_prepare(spawn, client, amqp_url, run_name, tmp_path) -> None:
    # The snapshot it dies in is aborted under its id (the previous one stays authoritative), the replica
    # comes back as a new process, the controller sees the new incarnation and restarts the rollouts it
    # lost, and the run finishes.
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG.replace("prepare_timeout_s: 10", "prepare_timeout_s: 2"))
    state = tmp_path / "state"
    actors = {}
    for role, replica in ROLES:
        env = {"PARKWAY_FAULTS": "participant_prepare:agent@2"} if (role, replica) == ("agent", 1) else {}
        actors[(role, replica)] = spawn(role, replica, args=("--config", str(config_path)), **env)
    for actor in actors.values():
        await wait_ready(client, actor, timeout=60)
    driver = start_driver(config_path, run_name, state, amqp_url)
    doomed = actors[("agent", 1)]
    assert await asyncio.to_thread(doomed.wait, 120) == -signal.SIGKILL  # died inside its second prepare

    def read_until_aborted() -> list[str]:
        assert driver.stderr is not None
        lines = []
        for line in driver.stderr:
            lines.append(line)
            if '"snapshot_aborted"' in line:
                return lines
        raise AssertionError("the driver ended without aborting the snapshot:\n" + "".join(lines[-20:]))

    aborted = await asyncio.to_thread(read_until_aborted)
    cid = json.loads(aborted[-1])["checkpoint_id"]
    run_dir = state / "snapshots" / run_name
    published = sorted(run_dir.glob("snapshot_*"))
    assert published, "the snapshot before the crash was published and stays"
    assert json.loads((published[-1] / "manifest.json").read_text())["checkpoint_id"] != cid
    spawn("agent", 1, args=("--config", str(config_path)))  # the replica restarts
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["snapshots_failed"] >= 1 and summary["snapshots_published"] >= 2
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert summary["mean_reward"] == 1.0 and summary["sessions_leaked"] == 0
    assert not list(run_dir.glob("tmp_*")), "an aborted snapshot leaves no temporary directory"
