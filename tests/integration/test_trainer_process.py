"""The trainer as its own OS process on the real RabbitMQ, SIGKILLed alone in the middle of a run.

Every actor is a process (``parkway actor``), the trainer among them (``trainer.host: service``), and
``parkway run`` drives the workload. The trainer kills itself at its second step (``PARKWAY_FAULTS``,
a real SIGKILL at an exact point): once after training but before its step record is durable (the
step is trained again), once after the record but before the answer (the record answers). The test
starts it again; the controller, which never died, resends its unanswered ``Train`` (same session,
same step). Each case asserts, from the trainer's own step records, that the steps are contiguous and
every group was trained exactly once, and that the run completed with every rollout sealed.
"""

from __future__ import annotations

import asyncio
import json
import signal

import msgspec
import pytest
from parkway.actors.storage.trainer import TrainerRecords
from parkway.protocol.ids import task_group_id
from parkway.protocol.messages import Trained

from tests.support.crash_cluster import ROLES, reference_digest
from tests.support.processes import start_driver, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

CONFIG = """
run: trainer-crash
seed: 23
rollout: {group_size: 3, max_turns: 6}
tasks: {builtin: bank, limit: 4}
policy: {host: inline, per_token_delay_s: 0.004}
topology: {agents: 2, resources: 2}
trainer: {batch_groups: 1, host: service, resend_s: 0.5}
recovery: {target_level: turn}
snapshot_interval_s: 0.3
prepare_timeout_s: 10
"""


@pytest.mark.parametrize(
    ("fault", "replayed"),
    [
        ("trainer_before_record@2", False),  # trained, not recorded: the restarted trainer trains it
        ("trainer_after_record@2", True),  # recorded, not answered: answered from the record
    ],
)
async def test_the_trainer_killed_alone_resumes_and_trains_each_group_once(
    spawn, client, amqp_url, run_name, tmp_path, fault, replayed
) -> None:
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG)
    state = tmp_path / "state"
    reference = await reference_digest(config_path, tmp_path)
    actors = [spawn(role, replica, args=("--config", str(config_path))) for role, replica in ROLES]
    trainer = spawn("trainer", 0, args=("--config", str(config_path)), PARKWAY_FAULTS=fault)
    for actor in [*actors, trainer]:
        await wait_ready(client, actor, timeout=60)

    driver = start_driver(config_path, run_name, state, amqp_url)
    code = await asyncio.to_thread(trainer.wait, 240)
    assert code == -signal.SIGKILL, f"the trainer did not die at {fault}:\n{trainer.log_tail(40)}"
    assert driver.poll() is None, "the run must still be going when the trainer dies"
    records_dir = state / "state" / run_name / "trainer" / "0" / "steps"
    before = TrainerRecords(records_dir).steps()
    assert [r.step for r in before] == ([1, 2] if replayed else [1])  # what the kill left on disk

    again = spawn("trainer", 0, args=("--config", str(config_path)))
    await wait_ready(client, again, timeout=60)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert (
        summary["rollouts_sealed"] == summary["rollouts_expected"] == 12 and summary["rollouts_failed"] == 0
    )
    assert summary["restores"] == 0  # the controller never died: the trainer alone recovered
    assert summary["transcripts_sha256"] == reference  # each rollout reached the trainer once

    steps = TrainerRecords(records_dir).steps()
    assert [r.step for r in steps] == [1, 2, 3, 4]  # contiguous, none twice
    groups = [g for r in steps for g in r.groups]
    assert sorted(groups) == [task_group_id(i) for i in range(4)]  # each group exactly once
    assert len({r.session for r in steps}) == 1  # one controller session asked for all of them
    assert steps[: len(before)] == before  # what was recorded before the kill was kept, not redone
    versions = [msgspec.msgpack.decode(r.reply, type=Trained).policy_version for r in steps]
    assert versions == [1, 2, 3, 4]  # the restarted plugin continued from step 1's state
    log = again.log_text()
    assert ('"train_replayed"' in log) == replayed, log[-3000:]
    assert '"trainer_resumed"' in log


async def test_the_whole_cluster_killed_with_its_trainer_trains_each_group_once(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    """The controller dies right after publishing its second snapshot, every other process (the
    trainer too) is SIGKILLed with it; a fresh cluster restores, the trainer goes back to the
    snapshot's step, and the groups after it are trained once each."""
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG)
    state = tmp_path / "state"
    reference = await reference_digest(config_path, tmp_path)

    async def cluster() -> list:
        started = [spawn(role, replica, args=("--config", str(config_path))) for role, replica in ROLES]
        started.append(spawn("trainer", 0, args=("--config", str(config_path))))
        for actor in started:
            await wait_ready(client, actor, timeout=60)
        return started

    first = await cluster()
    driver = start_driver(config_path, run_name, state, amqp_url, faults="after_publish@2")
    await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == -signal.SIGKILL
    for actor in first:
        actor.kill()
    snapshots = sorted((state / "snapshots" / run_name).glob("snapshot_*"))
    manifest = json.loads((snapshots[-1] / "manifest.json").read_text())
    anchored = manifest["trainer"]["step"]
    assert anchored < 4, "the crash must come before the last step, or this case proves nothing"

    await cluster()
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1
    assert (
        summary["rollouts_sealed"] == summary["rollouts_expected"] == 12 and summary["rollouts_failed"] == 0
    )
    assert summary["transcripts_sha256"] == reference
    steps = TrainerRecords(state / "state" / run_name / "trainer" / "0" / "steps").steps()
    assert [r.step for r in steps] == [1, 2, 3, 4]
    assert sorted(g for r in steps for g in r.groups) == [task_group_id(i) for i in range(4)]
    # The steps after the anchor were trained by the restored controller's session.
    assert len({r.session for r in steps[anchored:]}) == 1
