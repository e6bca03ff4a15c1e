"""Hostile messages over the real RabbitMQ at every role, each actor in its own process.

A cluster of processes (controller, agent, resources, policy, tq) takes a few hundred fuzzed
deliveries per role on its queue, each with a reply address. Every message must be settled (handled,
or refused with a dead letter and an ``Error`` reply carrying the same code); no input may find a
handler bug; every process must be the same one at the end. Then each does real work of its kind,
the fuzzed controller process stops cleanly, and a fresh controller runs a whole workload with
snapshots over the fuzzed participants: it completes with the transcripts of a run nobody fuzzed.
An oversized body (over the 16 MiB limit, under RabbitMQ's own) is refused the same way.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parkway.actors.launch.roles import ROLES
from parkway.actors.runtime.client import Client
from parkway.brokers.base import REQUEST_ID_HEADER, Envelope
from parkway.brokers.rabbitmq import RabbitBroker
from parkway.protocol import codec
from parkway.protocol.messages import (
    Abort,
    CanonicalRows,
    Commit,
    Committed,
    Error,
    FetchRows,
    Generate,
    Generated,
    Ok,
    Prepare,
    Prepared,
    Probe,
    ProbeResult,
    Resume,
    Rows,
    Run,
    SealRows,
    StagingRow,
    ToolCall,
    ToolResult,
)

from tests.support.embedded import embedded_digest
from tests.support.fuzz import REFUSALS, Fuzzed, envelope_of, fuzzed
from tests.support.processes import SECRET, actor_env, start_actor_process, status_of, wait_ready
from tests.support.rabbit import AMQP_URL, delete_run, rabbitmq_reachable
from tests.support.waiting import until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

EXAMPLES = int(os.environ.get("PARKWAY_FUZZ_PROCESS_EXAMPLES", "300"))  # per role
TARGETS = ("controller/0", "agent/0", "resources/0", "policy/0", "tq/0")
CONFIG = """
run: fuzzp
seed: 11
policy: {host: inline, per_token_delay_s: 0.001}
tasks: {builtin: bank, limit: 2}
rollout: {group_size: 2, max_turns: 4}
topology: {agents: 1, resources: 1}
trainer: {batch_groups: 1, checkpoint_every: 1}  # a snapshot at each train step, at least
snapshot_interval_s: 0.2
"""


class Cluster:
    def __init__(self, root: Path) -> None:
        assert rabbitmq_reachable(), f"RabbitMQ is not reachable at {AMQP_URL}"
        self.root = root
        self.run = f"fz{uuid.uuid4().hex[:8]}"
        self.config = root / "run.yaml"
        self.config.write_text(CONFIG)
        self.state = root / "state"
        self.processes = {
            address: start_actor_process(
                address.split("/")[0], 0, AMQP_URL, self.run, self.state, args=("--config", str(self.config))
            )
            for address in TARGETS
        }
        self.runner = asyncio.Runner()
        self.broker = RabbitBroker(AMQP_URL, self.run)
        self.runner.run(self.broker.start())
        self.client = Client(self.broker, secret=SECRET.encode(), sender="operator/0")
        for process in self.processes.values():
            self.runner.run(wait_ready(self.client, process, timeout=60))
        self.pids = {address: p.pid for address, p in self.processes.items()}
        self.sent: dict[str, int] = defaultdict(int)
        self.waiting: dict[str, asyncio.Future[Envelope]] = {}

    def send(self, address: str, item: Fuzzed) -> None:
        async def go() -> None:
            envelope = envelope_of(item, self.run, SECRET.encode(), address)
            if item.reply:
                request_id = f"fz-{address}-{self.sent[address]}"
                self.waiting[request_id] = self.broker._pending.open(request_id)
                envelope = replace(
                    envelope,
                    headers={**envelope.headers, REQUEST_ID_HEADER: request_id},
                    reply_to=self.broker.reply_address,
                )
            await self.broker.publish(address, envelope)

        self.sent[address] += 1
        self.runner.run(go())

    def close(self) -> None:
        for request_id, future in self.waiting.items():  # requests no reply answers (data messages)
            self.broker._pending.close(request_id)
            future.cancel()
        for process in self.processes.values():
            process.stop()
        self.runner.run(self.broker.close())
        self.runner.run(delete_run(AMQP_URL, self.run, [*TARGETS, "controller/0"]))
        self.runner.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("fuzz-processes"))
    yield c
    c.close()


@pytest.mark.parametrize("address", TARGETS)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_publish_fuzzed_messages(cluster: Cluster, address: str, data: st.DataObject) -> None:
    cluster.send(address, data.draw(fuzzed(focus=handled_types(address))))


@functools.cache
def handled_types(address: str) -> tuple[str, ...]:
    """The message types the role at ``address`` handles (read off an actor that is never started)."""
    from parkway.brokers.memory import MemoryBroker, MemoryHub

    actor = ROLES[address.split("/")[0]](MemoryBroker(MemoryHub(), "types"), secret=b"x")
    return tuple(cls.__name__ for cls in actor.handlers)


def soon(seconds: float = 10.0) -> float:
    return time.time() + seconds


async def settle(cluster: Cluster) -> dict[str, dict[str, int]]:
    """End what the fuzz left open (as a controller taking over would), wait until every queue is
    empty and nothing is in flight; each process's counts."""
    channel = await cluster.broker._connection.channel()  # type: ignore[union-attr]
    counts: dict[str, dict[str, int]] = {}
    async with asyncio.timeout(180):
        for address in TARGETS:
            while True:
                report = await status_of(cluster.client, address)
                if report.checkpoint_id and report.phase != "idle":
                    abort = Abort(
                        checkpoint_id=report.checkpoint_id, deadline=soon(), reason="the fuzz is over"
                    )
                    await cluster.client.request(address, abort)
                    continue
                queue = await channel.declare_queue(cluster.broker.queue_name(address), passive=True)
                if queue.declaration_result.message_count == 0 and report.in_flight == 0:
                    break
                await asyncio.sleep(0.1)
            counts[address] = report.counts
    await channel.close()
    return counts


def test_every_process_survived_settled_everything_and_answered_every_refusal(cluster: Cluster) -> None:
    async def check() -> None:
        counts = await settle(cluster)
        letters = await cluster.broker.read_dead_letters(limit=1_000_000)
        by_origin: dict[str, list] = defaultdict(list)
        for letter in letters:
            by_origin[letter.origin].append(letter)
        assert set(by_origin) <= set(TARGETS)
        for address in TARGETS:
            assert cluster.sent[address] == EXAMPLES
            refused = sum(counts[address].get(k, 0) for k in REFUSALS)
            assert counts[address].get("refused:internal", 0) == 0, [
                (x.code, x.detail) for x in by_origin[address] if x.code == "internal"
            ]
            assert len(by_origin[address]) == refused, address  # every refusal, dead-lettered
            assert refused > EXAMPLES * 0.2 and EXAMPLES - refused > EXAMPLES * 0.05, (address, refused)
        # Every refusal that carried a reply address got an Error with the dead letter's code.
        expected = [x for x in letters if x.envelope.headers.get(REQUEST_ID_HEADER) in cluster.waiting]
        assert len(expected) > len(letters) * 0.3
        futures = [cluster.waiting[x.envelope.headers[REQUEST_ID_HEADER]] for x in expected]
        await until(lambda: all(f.done() for f in futures), timeout=60)
        for letter, future in zip(expected, futures, strict=True):
            error = codec.decode(future.result().body, future.result().content_type)
            assert (
                isinstance(error, Error) and error.code.value == letter.code and error.detail == letter.detail
            )
        for address, process in cluster.processes.items():
            assert process.alive(), process.log_text()[-3000:]
            assert (await status_of(cluster.client, address)).pid == cluster.pids[address]

    cluster.runner.run(check())


def test_an_oversized_body_is_refused_by_a_process_and_dead_lettered(cluster: Cluster) -> None:
    async def check() -> None:
        limit = codec.MAX_BODY_BYTES
        body = (
            b'{"type": "Probe", "v": 1, "checkpoint_id": "big", "deadline": 1e10, "note": "'
            + b"x" * limit
            + b'"}'
        )
        envelope = Envelope(body, codec.JSON, "big", {"x-parkway-sender": "stranger/0"})
        reply = await cluster.broker.request("tq/0", envelope, deadline=soon(60))
        error = codec.decode(reply.body, reply.content_type)
        assert (
            isinstance(error, Error)
            and error.detail == f"body of {len(body)} bytes exceeds the limit of {limit} bytes"
        )

        async def letter() -> None:
            while not (taken := await cluster.broker.read_dead_letters(limit=1)):  # noqa: ASYNC110 - another process
                await asyncio.sleep(0.05)
            [found] = taken
            assert (found.code, found.origin, len(found.envelope.body)) == (
                "invalid_message",
                "tq/0",
                len(body),
            )

        await asyncio.wait_for(letter(), 60)
        assert (await status_of(cluster.client, "tq/0")).pid == cluster.pids["tq/0"]

    cluster.runner.run(check())


def test_then_every_process_does_real_work(cluster: Cluster) -> None:
    async def check() -> None:
        client = cluster.client
        for address in TARGETS[1:]:  # a checkpoint cycle at every participant
            cid = f"after-{address.split('/')[0]}"
            assert isinstance(
                await client.request(address, Prepare(checkpoint_id=cid, deadline=soon(30))), Prepared
            )
            committed = await client.request(
                address, Commit(checkpoint_id=cid, deadline=soon(30), location=f"tmp_{cid}")
            )
            assert isinstance(committed, Committed) and committed.files
            assert await client.request(address, Resume(checkpoint_id=cid, deadline=soon())) == Ok(
                detail="resumed"
            )
        generated = await client.request(
            "policy/0",
            Generate(rollout_id="after_p", attempt=0, call_index=0, token_ids=(1, 2, 3), max_tokens=8),
            correlation_id="after_p:0",
        )
        assert isinstance(generated, Generated) and generated.token_ids
        tool = ToolCall(
            rollout_id="after_r",
            attempt=0,
            call_index=0,
            env="counter",
            tool="increment",
            arguments={"by": 1},
        )
        result = await client.request("resources/0", tool, correlation_id="after_r:tool:0")
        assert isinstance(result, ToolResult) and result.ok
        await client.send(
            "tq/0",
            Rows(rows=(StagingRow(capture_key="after_t", turn=0, token_ids=(4,)),)),
            correlation_id="after_t:0",
        )
        seal = SealRows(
            rollout_id="after_t", attempt=0, capture_key="after_t", reward=1.0, staging_keys=("after_t:0",)
        )
        assert isinstance(await client.request("tq/0", seal, correlation_id="seal:after_t"), Ok)
        fetched = await client.request(
            "tq/0", FetchRows(rollout_ids=("after_t",)), correlation_id="fetch:after"
        )
        assert isinstance(fetched, CanonicalRows) and fetched.rows[0].turns[0].token_ids == (4,)
        before = (await status_of(client, "agent/0")).counts.get("rollouts_completed", 0)
        run = Run(rollout_id="after_a", attempt=0, group_id="after", env="counter", prompt="count", epoch=1)
        await client.send("agent/0", run, correlation_id="after_a")

        async def completed() -> None:
            while (await status_of(client, "agent/0")).counts.get("rollouts_completed", 0) == before:  # noqa: ASYNC110
                await asyncio.sleep(0.05)

        await asyncio.wait_for(completed(), 60)
        probe = await client.request("controller/0", Probe(checkpoint_id="after-probe", deadline=soon()))
        assert isinstance(probe, ProbeResult) and probe.pid == cluster.pids["controller/0"]

    cluster.runner.run(check())
    # The fuzzed controller process stops cleanly on SIGTERM ...
    controller = cluster.processes["controller/0"]
    controller.signal(signal.SIGTERM)
    assert controller.wait(30) == 0, controller.log_text()[-3000:]
    # ... and a fresh one runs a whole workload with snapshots over the fuzzed participants.
    result = subprocess.run(
        [sys.executable, "-m", "parkway.actors", "run", "--config", str(cluster.config), "--json"],
        env=actor_env(cluster.run, cluster.state, PARKWAY_BROKER_URL=AMQP_URL),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 4 and summary["rollouts_failed"] == 0
    assert summary["snapshots_published"] >= 1
    reference = cluster.runner.run(embedded_digest(cluster.config, cluster.root / "reference"))
    assert summary["transcripts_sha256"] == reference
    for address in TARGETS[1:]:
        assert cluster.processes[address].alive()
