"""The CLI against actor processes on the real RabbitMQ: publish, status, logs (saved and live)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from parkway.protocol.messages import Abort, Prepare

from tests.support.cli import parkway
from tests.support.processes import actor_env, run_variables, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


async def test_publish_prints_the_typed_reply(spawn, client, amqp_url, run_name, tmp_path) -> None:
    actor = spawn("policy")
    await wait_ready(client, actor)
    prepared = await asyncio.to_thread(
        parkway,
        "publish",
        "prepare",
        "--checkpoint-id",
        "cli-1",
        "--to",
        "policy/0",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    assert prepared.returncode == 0, prepared.stderr
    assert json.loads(prepared.stdout)["type"] == "Prepared"
    conflict = await asyncio.to_thread(
        parkway,
        "publish",
        "prepare",
        "--checkpoint-id",
        "cli-2",
        "--to",
        "policy/0",
        "--json-body",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    assert conflict.returncode == 1
    assert json.loads(conflict.stdout)["code"] == "checkpoint_conflict"
    bad = await asyncio.to_thread(
        parkway,
        "publish",
        "abort",
        "--checkpoint-id",
        "cli-1",
        "--to",
        "policy/0",
        "--set",
        "reason=x",
        "--set",
        "bogus=2",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    assert bad.returncode == 2 and "unknown field `bogus`" in bad.stderr
    aborted = await asyncio.to_thread(
        parkway,
        "publish",
        "abort",
        "--checkpoint-id",
        "cli-1",
        "--to",
        "policy/0",
        "--set",
        "reason=by hand",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    assert json.loads(aborted.stdout) == {"type": "Ok", "v": 1, "detail": "aborted in phase prepared"}


async def test_status_lists_each_actor(spawn, client, amqp_url, run_name, tmp_path) -> None:
    actors = [spawn("agent", 0), spawn("agent", 1)]
    for actor in actors:
        await wait_ready(client, actor)
    result = await asyncio.to_thread(
        parkway,
        "status",
        "--topology",
        "agent=2,tq=1",
        "--json",
        "--timeout",
        "2",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    rows = {row["address"]: row for row in json.loads(result.stdout)}
    assert rows["agent/0"]["pid"] == actors[0].pid and rows["agent/1"]["pid"] == actors[1].pid
    assert (rows["agent/1"]["role"], rows["agent/1"]["replica"], rows["agent/1"]["phase"]) == (
        "agent",
        1,
        "idle",
    )
    assert rows["tq/0"]["reachable"] is False  # nothing runs tq/0: said so, and the exit code says so
    assert rows["tq/0"]["heard_at"] is None
    assert result.returncode == 1


async def test_status_of_a_configuration_lists_its_shards_and_replicas(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    """``--config``: every actor of the run's topology, the second TQ shard and policy replica too."""
    actors = [spawn("tq", 1), spawn("policy", 1)]
    for actor in actors:
        await wait_ready(client, actor)
    config = tmp_path / "run.yaml"
    config.write_text("topology: {agents: 1, resources: 1, policies: 2, tq_shards: 2}\n")
    result = await asyncio.to_thread(
        parkway,
        "status",
        "--config",
        str(config),
        "--json",
        "--timeout",
        "1",
        "--window",
        "0",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    rows = {row["address"]: row for row in json.loads(result.stdout)}
    assert set(rows) == {"tq/0", "tq/1", "policy/0", "policy/1", "resources/0", "agent/0", "controller/0"}
    assert rows["tq/1"]["reachable"] and rows["tq/1"]["pid"] == actors[0].pid
    assert rows["policy/1"]["reachable"] and rows["policy/1"]["pid"] == actors[1].pid
    assert not rows["tq/0"]["reachable"] and result.returncode == 1  # not started: said so


async def test_status_finds_actors_by_heartbeat_and_shows_a_dead_ones_last_beat(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    policy, agent = spawn("policy"), spawn("agent", 3)
    for actor in (policy, agent):
        await wait_ready(client, actor)
    await client.call("policy/0", Prepare(checkpoint_id="hb-1", deadline=time.time() + 30))
    dead_pid = agent.pid
    agent.kill()  # SIGKILL: no goodbye, only its heartbeats remain on the stream
    # The topology names neither actor: both are found by their heartbeats.
    result = await asyncio.to_thread(
        parkway,
        "status",
        "--topology",
        "tq=0",
        "--json",
        "--timeout",
        "1",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    rows = {row["address"]: row for row in json.loads(result.stdout)}
    assert set(rows) == {"policy/0", "agent/3"}, rows
    live, dead = rows["policy/0"], rows["agent/3"]
    assert live["reachable"] and live["phase"] == "prepared" and live["checkpoint_id"] == "hb-1"
    assert live["lease_expires_at"] > time.time() - 60 and live["pid"] == policy.pid
    assert not dead["reachable"] and dead["pid"] == dead_pid and dead["heard_at"] <= time.time()
    assert result.returncode == 1
    table = await asyncio.to_thread(
        parkway,
        "status",
        "--topology",
        "tq=0",
        "--timeout",
        "1",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["ROLE", "REPLICA", "PHASE", "CHECKPOINT"]
    [agent_line] = [line for line in lines if line.startswith("agent")]
    assert "ago" in agent_line and "no reply" in agent_line and str(dead_pid) in agent_line
    [policy_line] = [line for line in lines if line.startswith("policy")]
    assert "prepared" in policy_line and "hb-1" in policy_line


async def test_logs_of_one_checkpoint_from_two_processes(spawn, client, amqp_url, run_name, tmp_path) -> None:
    agent, tq = spawn("agent"), spawn("tq")
    for actor in (agent, tq):
        await wait_ready(client, actor)
    for cid in ("wanted-1", "other-1"):
        for address in ("agent/0", "tq/0"):
            await client.call(address, Prepare(checkpoint_id=cid, deadline=time.time() + 10))
            await client.call(address, Abort(checkpoint_id=cid, deadline=time.time() + 10))
    result = await asyncio.to_thread(
        parkway,
        "logs",
        "--checkpoint-id",
        "wanted-1",
        "--json",
        "--idle",
        "2",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert {r["checkpoint_id"] for r in records} == {"wanted-1"}
    assert {r["actor"] for r in records} == {"agent/0", "tq/0"}
    assert {(r["actor"], r["on"]) for r in records if r["event"] == "phase"} == {
        (a, e) for a in ("agent/0", "tq/0") for e in ("prepare", "parked", "abort")
    }
    readable = await asyncio.to_thread(
        parkway,
        "logs",
        "--checkpoint-id",
        "wanted-1",
        "--actor",
        "tq/0",
        "--idle",
        "2",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    lines = readable.stdout.splitlines()
    assert lines and all(" tq/0 " in line for line in lines) and any("phase" in line for line in lines)
    # The same lines from the processes' saved log files (their stderr), without the broker.
    saved = await asyncio.to_thread(
        parkway,
        "logs",
        "--checkpoint-id",
        "wanted-1",
        "--json",
        str(agent.log_path),
        str(tq.log_path),
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL="amqp://nowhere.invalid/"),
    )
    assert saved.returncode == 0, saved.stderr
    from_files = [json.loads(line) for line in saved.stdout.splitlines()]
    assert sorted((r["actor"], r["event"], r["ts"]) for r in from_files) == sorted(
        (r["actor"], r["event"], r["ts"]) for r in records
    )
    by_event = await asyncio.to_thread(
        parkway,
        "logs",
        "--event",
        "phase",
        "--actor",
        "agent/0",
        str(agent.log_path),
        str(tq.log_path),
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL="amqp://nowhere.invalid/"),
    )
    assert by_event.returncode == 0
    phases = by_event.stdout.splitlines()
    assert len(phases) == 6 and all(" agent/0 " in line and " phase " in line for line in phases)


async def test_logs_follow_a_live_checkpoint(spawn, client, amqp_url, run_name, tmp_path) -> None:
    agent, tq = spawn("agent"), spawn("tq")
    for actor in (agent, tq):
        await wait_ready(client, actor)
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "parkway.actors",
            "logs",
            "--checkpoint-id",
            "live-1",
            "--follow",
            "--json",
        ],
        env=actor_env(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for address in ("agent/0", "tq/0"):
            await client.call(address, Prepare(checkpoint_id="live-1", deadline=time.time() + 10))
        seen: set[str] = set()

        def read_until_both() -> None:
            assert follower.stdout is not None
            for line in follower.stdout:
                record = json.loads(line)
                assert record["checkpoint_id"] == "live-1"
                if record["event"] == "prepared":
                    seen.add(record["actor"])
                if seen == {"agent/0", "tq/0"}:
                    return

        await asyncio.wait_for(asyncio.to_thread(read_until_both), 30)
        for address in ("agent/0", "tq/0"):
            await client.call(address, Abort(checkpoint_id="live-1", deadline=time.time() + 10))
    finally:
        follower.kill()
        follower.wait(10)
    assert seen == {"agent/0", "tq/0"}


async def test_publish_with_the_wrong_secret_says_so(spawn, client, amqp_url, run_name, tmp_path) -> None:
    """The actor refuses it and answers, signed with the run's secret; the CLI cannot verify that answer
    with its own (wrong) one: a message naming why, exit 2, no traceback."""
    actor = spawn("tq")
    await wait_ready(client, actor)
    wrong = await asyncio.to_thread(
        parkway,
        "publish",
        "status",
        "--to",
        "tq/0",
        **{
            **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
            "PARKWAY_SECRET": "not-it",
        },
    )
    assert wrong.returncode == 2, wrong.stderr
    assert "does not verify" in wrong.stderr and "a key not of this run's table" in wrong.stderr
    assert "Traceback" not in wrong.stderr
