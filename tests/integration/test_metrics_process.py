"""An actor process serves its Prometheus metrics over HTTP; scraped here like Prometheus would."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pytest
from parkway.actors.runtime.client import Client
from parkway.protocol.messages import Probe, ProbeResult

from tests.support.processes import wait_ready
from tests.support.rabbit import connection_pid
from tests.support.scrape import free_port, sample, scrape
from tests.support.waiting import until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


async def test_an_actor_process_serves_its_metrics(spawn, client: Client) -> None:
    port = free_port()
    actor = spawn("tq", args=("--metrics-port", str(port)))
    await wait_ready(client, actor)
    before = await asyncio.to_thread(scrape, port)
    tq = {"role": "tq", "replica": "0"}
    assert sample(before, "parkway_messages_total", **tq, type="Probe", outcome="handled") is None
    reply = await client.request("tq/0", Probe(checkpoint_id="met-1", deadline=time.time() + 10))
    assert isinstance(reply, ProbeResult)
    after = await asyncio.to_thread(scrape, port)
    assert sample(after, "parkway_messages_total", **tq, type="Probe", outcome="handled") == 1
    statuses = sample(after, "parkway_messages_total", **tq, type="Status", outcome="handled")
    assert statuses is not None and statuses >= 1  # wait_ready asked for Status
    assert sample(after, "parkway_errors_total", **tq, code="invalid_message") == 0
    assert sample(after, "parkway_phase_seconds_count", **tq, phase="preparing") == 0
    assert sample(after, "parkway_broker_reconnects_total") == 0


@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl of the local RabbitMQ")
async def test_a_connection_closed_by_the_broker_counts_a_reconnect(spawn, client: Client, run_name) -> None:
    port = free_port()
    actor = spawn("tq", PARKWAY_METRICS_PORT=str(port))  # from the environment this time
    await wait_ready(client, actor)
    pid = await asyncio.to_thread(connection_pid, f"parkway-{run_name}-tq-0")
    assert pid is not None
    subprocess.run(
        ["rabbitmqctl", "close_connection", pid, "test: force a reconnect"],
        capture_output=True,
        timeout=30,
        check=True,
    )

    def reconnects() -> float | None:
        return sample(scrape(port), "parkway_broker_reconnects_total")

    await until(lambda: reconnects() == 1, timeout=30, poll=0.1)
    # And it serves on the new connection.
    reply = await client.request("tq/0", Probe(checkpoint_id="met-2", deadline=time.time() + 20))
    assert isinstance(reply, ProbeResult) and reply.pid == actor.pid
