"""A snapshot restored onto another number of agents and tool servers, every actor its own process on
the real RabbitMQ.

Two agents and two tool servers run the crash workload; the controller is SIGKILLed right after the
first snapshot in which both agents hold rollouts mid-flight, and the test SIGKILLs every other
process. The cluster comes back as three agents and one tool server, or as one agent, three tool servers and
two policy replicas: the restore places each saved rollout on a live agent (agent 1's all moved to agent 0 when
there is one), its tool session on that agent's tool server (read from the directory of the server
that saved it), and the run finishes: every rollout sealed once, each bank transfer applied once, the
finished turns not generated again, the transcripts those of a run that never crashed.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.crash_cluster import CONFIG, CRASH_FAULTS, ROLES, crash_at, reference_digest, start_driver
from tests.support.processes import wait_ready
from tests.support.restores import saved_by_agent

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


@pytest.mark.parametrize(("agents", "resources", "policies"), [(3, 1, 1), (1, 3, 2)])
async def test_a_snapshot_of_two_and_two_continues_on_another_topology(
    spawn, client, amqp_url, run_name, tmp_path, agents: int, resources: int, policies: int
) -> None:
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG)
    state = tmp_path / "state"
    reference = await reference_digest(config_path, tmp_path)

    first = [spawn(role, replica, args=("--config", str(config_path))) for role, replica in ROLES]
    for actor in first:
        await wait_ready(client, actor, timeout=60)
    driver = start_driver(config_path, run_name, state, amqp_url, faults=CRASH_FAULTS)
    snapshot = await asyncio.to_thread(
        crash_at,
        driver,
        state / "snapshots" / run_name,
        lambda s: all(saved_by_agent(s).get(i) for i in (0, 1)),
        "rollouts of both agents",
    )
    for actor in first:
        actor.kill()
    held = saved_by_agent(snapshot)
    manifest = json.loads((snapshot / "manifest.json").read_text())

    elastic = tmp_path / "elastic.yaml"
    elastic.write_text(
        CONFIG.replace(
            "topology: {agents: 2, resources: 2}",
            f"topology: {{agents: {agents}, resources: {resources}, policies: {policies}}}",
        )
    )
    roles = [("tq", 0)] + [("policy", i) for i in range(policies)]
    roles += [("resources", i) for i in range(resources)] + [("agent", i) for i in range(agents)]
    second = [spawn(role, replica, args=("--config", str(elastic))) for role, replica in roles]
    for actor in second:
        await wait_ready(client, actor, timeout=60)
    driver = start_driver(elastic, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    assert '"restore_onto_another_topology"' in err
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(manifest["episodes"]) > 0
    assert summary["rollouts_moved"] == (len(held[1]) if agents == 1 else 0)
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert summary["mean_reward"] == 1.0  # each moved bank session's balances replay: every transfer once
    assert summary["sessions_leaked"] == 0 and summary["tool_mutations_duplicated"] == 0
    assert summary["turns_regenerated"] <= summary["rollouts_restored"]  # only the calls in flight
    assert summary["transcripts_sha256"] == reference
    assert set(summary["rollouts_by_agent"]) <= {f"agent/{i}" for i in range(agents)}
    assert set(summary["tool_calls_by_resources"]) <= {f"resources/{i}" for i in range(resources)}
    assert set(summary["model_calls_by_policy"]) == {f"policy/{i}" for i in range(policies)}, out


async def test_two_tq_shards_and_two_policy_replicas_survive_a_sigkill(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    """No singletons: two TQ shards and two policy replicas, each its own process. The cluster is
    SIGKILLed right after a snapshot holding rollouts mid-flight and comes back the same: each shard's
    rows and each replica's cut restored, every rollout sealed once, transcripts as one TQ and one
    policy would have made them."""
    config_path = tmp_path / "run.yaml"
    config_path.write_text(
        CONFIG.replace(
            "topology: {agents: 2, resources: 2}",
            "topology: {agents: 2, resources: 2, policies: 2, tq_shards: 2}",
        )
    )
    reference = await reference_digest(config_path, tmp_path)
    roles = [("tq", 0), ("tq", 1), ("policy", 0), ("policy", 1), *ROLES[2:]]

    async def start() -> list:
        actors = [spawn(role, replica, args=("--config", str(config_path))) for role, replica in roles]
        for actor in actors:
            await wait_ready(client, actor, timeout=60)
        return actors

    first = await start()
    driver = start_driver(config_path, run_name, state := tmp_path / "state", amqp_url, faults=CRASH_FAULTS)
    snapshot = await asyncio.to_thread(
        crash_at, driver, state / "snapshots" / run_name, lambda s: bool(saved_by_agent(s)), "rollouts"
    )
    for actor in first:
        actor.kill()
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert manifest["replicas"] == {"agent": 2, "policy": 2, "resources": 2, "tq": 2}
    assert (snapshot / "tq" / "staging.msgpack").is_file() and (
        snapshot / "tq" / "1" / "staging.msgpack"
    ).is_file()

    await start()
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(manifest["episodes"]) > 0
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert summary["mean_reward"] == 1.0 and summary["tool_mutations_duplicated"] == 0
    assert summary["turns_regenerated"] <= summary["rollouts_restored"]
    assert summary["transcripts_sha256"] == reference
    assert set(summary["model_calls_by_policy"]) == {"policy/0", "policy/1"}
