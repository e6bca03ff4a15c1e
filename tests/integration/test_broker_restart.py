"""A broker restart under live actor processes, on a throwaway RabbitMQ node this test owns.

Found from outside (issue 14, hole 1): after a broker restart during ``prepare`` a ``resources``
replica kept receiving requests but every reply failed (``reply to 'amq.rabbitmq.reply-to...' failed:
<RobustChannel ...> closed``): the channel replies were published on was not reopened, the failure
escaped the delivery handler, and the requesters waited out their 600 s deadlines.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from parkway.actors.launch.rabbit_node import RabbitNode, rabbitmq_bin
from parkway.actors.runtime.client import Client
from parkway.brokers.base import BrokerError
from parkway.brokers.rabbitmq import RabbitBroker
from parkway.protocol.messages import Probe, ProbeResult

from tests.support.processes import SECRET, Process, start_actor_process, status_of, wait_handling, wait_ready
from tests.support.waiting import until

pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.slow,
    pytest.mark.skipif(rabbitmq_bin() is None, reason="needs the scripts of a local RabbitMQ installation"),
]


def probe_lines(state_root: Path, checkpoint_id: str) -> list[str]:
    """The executions of ``Probe(checkpoint_id)`` the resources replicas journaled."""
    return [
        line
        for log in (state_root / "state").rglob("probe.log")
        for line in log.read_text().splitlines()
        if line.split()[0] == checkpoint_id
    ]


async def until_replayed(client: Client, address: str, *, within: float) -> None:
    """Wait until the actor at ``address`` reports a reply replayed from its cache."""
    give_up = time.time() + within
    while True:
        try:
            status = await status_of(client, address)
            if status.counts.get("replayed", 0) >= 1:
                return
        except BrokerError:
            pass  # this requester's own connection is not back yet, or its reply was lost
        assert time.time() < give_up, f"{address} replayed no reply within {within:.0f}s"
        await asyncio.sleep(0.2)


@pytest.fixture
def node() -> Iterator[RabbitNode]:
    with RabbitNode("parkway-restart-test") as started:
        yield started


async def probe_until_answered(client: Client, address: str, checkpoint_id: str, *, within: float) -> Probe:
    """Send ``Probe`` until one gets a reply: a request sent while the requester's own connection is
    still down fails at once (``BrokerError``), which is what the caller retries on."""
    give_up = time.time() + within
    while True:
        try:
            reply = await client.request(
                address, Probe(checkpoint_id=checkpoint_id, deadline=min(give_up, time.time() + 20))
            )
        except BrokerError:
            if time.time() > give_up:
                raise
            await asyncio.sleep(0.2)
            continue
        assert isinstance(reply, ProbeResult), reply
        return reply


async def test_actors_answer_requests_after_a_broker_restart(node: RabbitNode, tmp_path: Path) -> None:
    run = "restart"
    started: list[Process] = []
    try:
        async with RabbitBroker(node.url, run) as broker:
            client = Client(broker, secret=SECRET.encode(), sender="controller/0")
            for replica in (0, 1):
                actor = start_actor_process("resources", replica, node.url, run, tmp_path / "state")
                started.append(actor)
                await wait_ready(client, actor)
            assert isinstance(
                await client.request("resources/0", Probe(checkpoint_id="before", deadline=time.time() + 30)),
                ProbeResult,
            )

            # A command is being handled when the broker goes away, and its handler finishes (its effect,
            # the probe log line, is written) while the broker is down: the reply cannot be sent then.
            # The actor is frozen (SIGSTOP) across stop_app so that its reply cannot go out before.
            in_flight = asyncio.ensure_future(
                client.request(
                    "resources/1", Probe(checkpoint_id="during", deadline=time.time() + 120, work_s=3.0)
                )
            )
            await wait_handling(client, "resources/1")
            started[1].signal(signal.SIGSTOP)
            await asyncio.to_thread(node.stop_app)
            started[1].signal(signal.SIGCONT)
            with pytest.raises(BrokerError):
                await in_flight  # fails fast: the reply address died with the requester's connection
            await until(lambda: bool(probe_lines(tmp_path, "during")), timeout=30)
            await asyncio.to_thread(node.start_app)

            await until(lambda: broker.reconnects >= 1, timeout=60, poll=0.1)
            # The command held over the restart is redelivered and answered from the reply cache (to an
            # address that died; nobody gets it). Everything sent after that is answered too.
            await until_replayed(client, "resources/1", within=60)
            for replica in (0, 1):
                for n in range(3):
                    reply = await probe_until_answered(
                        client, f"resources/{replica}", f"after-{replica}-{n}", within=60
                    )
                    assert reply.pid == started[replica].pid  # the same process, not a restarted one
            assert len(probe_lines(tmp_path, "during")) == 1  # executed once, before the restart
            assert all(actor.alive() for actor in started)
            assert list(broker.duplicate_reply_ids) == []
            assert "Task exception was never retrieved" not in started[1].log_text()
    finally:
        for actor in started:
            actor.stop()
