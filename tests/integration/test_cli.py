"""The CLI against actor processes on the real RabbitMQ: publish, status, logs (saved and live)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from parkway.protocol.messages import Abort, Prepare

from tests.integration.processes import actor_env, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


def parkway(
    args: list[str], run: str, tmp_path, url: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "parkway.actors.cli", *args],
        env=actor_env(run, tmp_path / "cli", PARKWAY_BROKER_URL=url),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


async def test_publish_prints_the_typed_reply(spawn, client, amqp_url, run_name, tmp_path) -> None:
    actor = spawn("policy")
    await wait_ready(client, actor)
    prepared = await asyncio.to_thread(
        parkway,
        ["publish", "prepare", "--checkpoint-id", "cli-1", "--to", "policy/0"],
        run_name,
        tmp_path,
        amqp_url,
    )
    assert prepared.returncode == 0, prepared.stderr
    assert json.loads(prepared.stdout)["type"] == "Prepared"
    conflict = await asyncio.to_thread(
        parkway,
        ["publish", "prepare", "--checkpoint-id", "cli-2", "--to", "policy/0", "--json-body"],
        run_name,
        tmp_path,
        amqp_url,
    )
    assert conflict.returncode == 1
    assert json.loads(conflict.stdout)["code"] == "checkpoint_conflict"
    bad = await asyncio.to_thread(
        parkway,
        [
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
        ],
        run_name,
        tmp_path,
        amqp_url,
    )
    assert bad.returncode == 2 and "unknown field `bogus`" in bad.stderr
    aborted = await asyncio.to_thread(
        parkway,
        ["publish", "abort", "--checkpoint-id", "cli-1", "--to", "policy/0", "--set", "reason=by hand"],
        run_name,
        tmp_path,
        amqp_url,
    )
    assert json.loads(aborted.stdout) == {"type": "Ok", "v": 1, "detail": "aborted in phase prepared"}


async def test_status_lists_each_actor(spawn, client, amqp_url, run_name, tmp_path) -> None:
    actors = [spawn("agent", 0), spawn("agent", 1)]
    for actor in actors:
        await wait_ready(client, actor)
    result = await asyncio.to_thread(
        parkway,
        ["status", "--topology", "agent=2,tq=1", "--json", "--timeout", "2"],
        run_name,
        tmp_path,
        amqp_url,
    )
    rows = {row["address"]: row for row in json.loads(result.stdout)}
    assert rows["agent/0"]["pid"] == actors[0].pid and rows["agent/1"]["pid"] == actors[1].pid
    assert rows["tq/0"]["reachable"] is False  # nothing runs tq/0: said so, and the exit code says so
    assert result.returncode == 1


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
        ["logs", "--checkpoint-id", "wanted-1", "--json", "--idle", "2"],
        run_name,
        tmp_path,
        amqp_url,
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
        ["logs", "--checkpoint-id", "wanted-1", "--actor", "tq/0", "--idle", "2"],
        run_name,
        tmp_path,
        amqp_url,
    )
    lines = readable.stdout.splitlines()
    assert lines and all(" tq/0 " in line for line in lines) and any("phase" in line for line in lines)


async def test_logs_follow_a_live_checkpoint(spawn, client, amqp_url, run_name, tmp_path) -> None:
    agent, tq = spawn("agent"), spawn("tq")
    for actor in (agent, tq):
        await wait_ready(client, actor)
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "parkway.actors.cli",
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
