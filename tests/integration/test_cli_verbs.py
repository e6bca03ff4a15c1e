"""The CLI verbs not covered elsewhere, on the real RabbitMQ with actors in separate processes:
``up --broker``, ``dead-letters``, ``sign`` (with a plain pika client) and ``snapshot`` (a running
workload's controller asked for a snapshot now, followed live with ``logs --follow``)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import pika
import pytest
from parkway.brokers.base import Envelope
from parkway.protocol.signing import SENDER_HEADER

from tests.support.cli import parkway
from tests.support.processes import actor_env, run_variables, status_of, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


async def test_up_on_the_real_broker_serves_every_actor_until_sigterm(
    client, amqp_url, run_name, tmp_path, rabbit_cleanup
) -> None:
    rabbit_cleanup(run_name, ["tq/0", "agent/0", "controller/0"])
    up = subprocess.Popen(
        [sys.executable, "-m", "parkway.actors", "up", "--topology", "tq=1,agent=1"],
        env=actor_env(run_name, tmp_path / "state", PARKWAY_BROKER_URL=amqp_url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines: list[str] = []

        def read_until_ready() -> None:
            assert up.stderr is not None
            for line in up.stderr:
                lines.append(line)
                if "parkway up: 2 actors" in line:
                    return

        await asyncio.wait_for(asyncio.to_thread(read_until_ready), 60)
        assert any(line.startswith("tq ") for line in lines) and any(
            line.startswith("agent ") for line in lines
        )
        status = await asyncio.to_thread(
            parkway,
            "status",
            "--topology",
            "tq=1,agent=1",
            "--json",
            **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
        )
        rows = {row["address"]: row for row in json.loads(status.stdout)}
        assert rows["tq/0"]["pid"] == rows["agent/0"]["pid"] == up.pid  # one process hosts both
        assert status.returncode == 0
        up.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(up.wait, 30) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


async def test_dead_letters_shows_what_an_actor_refused(spawn, client, amqp_url, run_name, tmp_path) -> None:
    actor = spawn("tq")
    await wait_ready(client, actor)
    garbage = Envelope(
        body=b"\x93not msgpack at all",
        content_type="application/msgpack",
        correlation_id="bad-1",
        headers={SENDER_HEADER: "mallory/0"},
    )
    await client.broker.publish("tq/0", garbage)  # unsigned: refused at the edge, dead-lettered

    letters: list[dict] = []

    async def read() -> bool:
        result = await asyncio.to_thread(
            parkway,
            "dead-letters",
            "take",
            "--limit",
            "10",
            **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
        )
        assert result.returncode == 0, result.stderr
        letters.extend(json.loads(line) for line in result.stdout.splitlines())
        return any(letter["correlation_id"] == "bad-1" for letter in letters)

    async with asyncio.timeout(30):
        while not await read():  # noqa: ASYNC110 - the refusal is asynchronous: read until it is there
            await asyncio.sleep(0.2)
    [letter] = [letter for letter in letters if letter["correlation_id"] == "bad-1"]
    assert letter["code"] == "unauthorized" and letter["origin"] == "tq/0"
    assert letter["sender"] == "mallory/0" and letter["bytes"] == len(garbage.body)
    again = await asyncio.to_thread(
        parkway,
        "dead-letters",
        "take",
        **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
    )
    assert "bad-1" not in again.stdout  # taken off the queue, not just peeked at


async def test_sign_gives_headers_a_plain_pika_client_can_use(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    actor = spawn("resources")
    await wait_ready(client, actor)
    body = json.dumps(
        {"type": "Probe", "v": 1, "checkpoint_id": "signed-1", "deadline": time.time() + 30, "note": "hi"}
    ).encode()
    signed = subprocess.run(
        [
            sys.executable,
            "-m",
            "parkway.actors",
            "sign",
            "--correlation-id",
            "signed-1",
            "--sender",
            "ops/1",
            "--to",
            "resources/0",
        ],
        input=body,
        env=actor_env(run_name, tmp_path / "cli"),
        capture_output=True,
        timeout=30,
    )
    assert signed.returncode == 0, signed.stderr
    headers = json.loads(signed.stdout)

    def request() -> dict:
        connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
        try:
            channel = connection.channel()
            reply_queue = channel.queue_declare("", exclusive=True).method.queue
            channel.basic_publish(
                exchange=f"pk.{run_name}",
                routing_key="resources/0",
                body=body,
                properties=pika.BasicProperties(
                    content_type="application/json",
                    correlation_id="signed-1",
                    reply_to=reply_queue,
                    headers=headers,
                ),
            )
            for _m, _p, reply in channel.consume(reply_queue, auto_ack=True, inactivity_timeout=15):
                assert reply is not None, "no reply within 15 s"
                return json.loads(reply)
            raise AssertionError("unreachable")
        finally:
            connection.close()

    reply = await asyncio.to_thread(request)
    assert reply["type"] == "ProbeResult" and reply["note"] == "hi" and reply["pid"] == actor.pid


CONFIG = """
run: snapnow
seed: 3
rollout: {group_size: 3, max_turns: 5}
tasks: {builtin: counter, limit: 4}
policy: {host: inline, per_token_delay_s: 0.02}
topology: {agents: 1, resources: 1}
snapshot_interval_s: 3600
"""


async def test_snapshot_asks_a_running_workload_for_a_snapshot_now(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    state = tmp_path / "state"
    actors = [
        spawn(role, 0, args=("--config", str(config))) for role in ("tq", "policy", "resources", "agent")
    ]
    for actor in actors:
        await wait_ready(client, actor, timeout=60)
    driver = subprocess.Popen(
        [sys.executable, "-m", "parkway.actors", "run", "--config", str(config), "--json"],
        env=actor_env(run_name, state, PARKWAY_BROKER_URL=amqp_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        agent = actors[-1]

        async def agent_busy() -> bool:
            return (await status_of(client, agent.address)).in_flight > 0

        async with asyncio.timeout(60):
            while not await agent_busy():  # noqa: ASYNC110 - until the workload's rollouts run
                await asyncio.sleep(0.05)
        # Follow the snapshot's lines live, from every process, before it exists.
        follower = subprocess.Popen(
            [
                sys.executable, "-m", "parkway.actors", "logs",
                "--checkpoint-id", "live-snap-1", "--follow", "--json",
            ],
            env=actor_env(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            taken = await asyncio.to_thread(
                parkway,
                "snapshot",
                "--checkpoint-id",
                "live-snap-1",
                "--timeout",
                "30",
                **run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url),
            )
            assert taken.returncode == 0, taken.stdout + taken.stderr
            reply = json.loads(taken.stdout)
            assert reply == {
                "type": "SnapshotTaken",
                "v": 1,
                "snapshot": reply["snapshot"],
                "checkpoint_id": "live-snap-1",
                "skipped": False,
            }
            participants = {"tq/0", "policy/0", "resources/0", "agent/0"}
            seen: dict[str, set[str]] = {}

            def read_until_resumed() -> None:
                assert follower.stdout is not None
                for line in follower.stdout:
                    record = json.loads(line)
                    assert record["checkpoint_id"] == "live-snap-1"
                    seen.setdefault(record["actor"], set()).add(record.get("on") or record["event"])
                    resumed = {a for a in participants if "resume" in seen.get(a, set())}
                    if resumed == participants and "snapshot_published" in seen.get("controller/0", set()):
                        return

            try:
                await asyncio.wait_for(asyncio.to_thread(read_until_resumed), 30)
            except TimeoutError:
                raise AssertionError(f"not every process showed the whole checkpoint: {seen}") from None
        finally:
            follower.kill()
            follower.wait(10)
        for actor in participants:  # each process went through the whole checkpoint, live
            assert {"prepared", "committed", "resume"} <= seen[actor], (actor, seen[actor])
        assert {"gate_closed", "snapshot_published"} <= seen["controller/0"]
        manifest = json.loads(
            (state / "snapshots" / run_name / reply["snapshot"] / "manifest.json").read_text()
        )
        assert manifest["checkpoint_id"] == "live-snap-1" and manifest["episodes"]
        out, err = await asyncio.to_thread(driver.communicate, timeout=180)
        assert driver.returncode == 0, err[-3000:]
        summary = json.loads(out)
        assert summary["snapshots_published"] >= 1 and summary["rollouts_sealed"] == 12
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)
