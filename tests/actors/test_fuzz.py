"""Hostile messages at every role of a whole in-memory cluster: each is handled or refused, none kills.

For each role (controller, agent, resources, policy, tq) one cluster lives across all the hypothesis
examples; the fuzzed deliveries go to that role's queue only (messages of every type, so most are
the wrong type for it). Afterwards the same actor must answer ``Status``, every message it refused at
its edge must be in the dead-letter queue with its code and, where it carried a reply address, have
had an ``Error`` reply with that code; no input may have found a handler bug (``internal``). Then
the actor does real work: a checkpoint cycle, its own kind of message, and a whole workload with a
snapshot on the same cluster.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parkway.actors.launch.roles import ROLES
from parkway.actors.launch.workload import role_options
from parkway.actors.roles.controller.controller import Controller
from parkway.actors.run.config import from_dict
from parkway.actors.run.tasks import load_tasks
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.participant import Participant
from parkway.brokers.base import REQUEST_ID_HEADER, Envelope, Lane
from parkway.brokers.memory import MemoryBroker, MemoryHub
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
    Persist,
    Persisted,
    Prepare,
    Prepared,
    Resume,
    Rows,
    Run,
    SealRows,
    StagingRow,
    Status,
    StatusReport,
    ToolCall,
    ToolResult,
)

from tests.support.fuzz import REFUSALS, Fuzzed, Signers, envelope_of, fuzzed
from tests.support.signed import SECRET
from tests.support.waiting import until

RUN = "fuzz"
EXAMPLES = int(os.environ.get("PARKWAY_FUZZ_EXAMPLES", "1000"))
TARGETS = ("controller/0", "agent/0", "resources/0", "policy/0", "tq/0")
CONFIG = {
    "run": RUN,
    "seed": 7,
    "policy": {"host": "inline"},
    "tasks": {"builtin": "counter", "limit": 2},
    "rollout": {"group_size": 2, "max_turns": 3},
    "topology": {"agents": 1, "resources": 1},
    "trainer": {"batch_groups": 1, "checkpoint_every": 1},  # each train step takes a snapshot
    "snapshot_interval_s": 0.02,
}


class Cluster:
    """A whole embedded cluster on one event loop, living across all hypothesis examples of one role."""

    def __init__(self, root: Path, target: str) -> None:
        self.root, self.target = root, target
        self.runner = asyncio.Runner()
        self.hub = MemoryHub()
        self.config = from_dict(CONFIG)
        self.sent = 0
        self.waiting: dict[str, asyncio.Future[Envelope]] = {}  # request id -> its reply
        self.runner.run(self._start())

    async def _start(self) -> None:
        self.broker = MemoryBroker(self.hub, RUN)
        await self.broker.start()
        self.actors: dict[str, Any] = {}
        for role, count in (("tq", 1), ("policy", 1), ("resources", 1), ("agent", 1), ("controller", 1)):
            cls = ROLES[role]
            for replica in range(count):
                kwargs: dict[str, Any] = {
                    "secret": SECRET,
                    "replica": replica,
                    **role_options(role, self.config),
                }
                if issubclass(cls, Participant):
                    kwargs["snapshot_root"] = self.root / "snapshots"
                    kwargs["lease_grace_s"] = 0.2  # a checkpoint the fuzz left open lapses soon
                actor = cls(self.broker, **kwargs)
                await actor.start()
                self.actors[actor.address] = actor
        self.client = Client(self.broker, secret=SECRET, sender="operator/0")
        self.signers = Signers.of(self.broker, SECRET)

    @property
    def actor(self) -> Any:
        return self.actors[self.target]

    def send(self, item: Fuzzed) -> None:
        async def go() -> None:
            envelope = envelope_of(
                item, self.signers, self.target
            )  # (odd reply addresses, replays: over RabbitMQ)
            if item.reply:
                request_id = f"fz-{self.sent}"
                self.waiting[request_id] = self.broker._pending.open(request_id)
                envelope = replace(
                    envelope,
                    headers={**envelope.headers, REQUEST_ID_HEADER: request_id},
                    reply_to=self.broker.reply_address,
                )
            await self.broker.publish(self.target, envelope)
            # Let the handler run as far as it can without waiting on anything (a command may hold
            # legitimately, e.g. a Generate behind a closed admission gate); the end waits for all.
            for _ in range(100):
                if not self.actor.in_flight:
                    break
                await asyncio.sleep(0)

        self.sent += 1
        self.runner.run(asyncio.wait_for(go(), 30))

    def run(self, coro: Any) -> Any:
        return self.runner.run(coro)

    async def stop(self) -> None:
        for request_id, future in self.waiting.items():  # requests no reply answers (data messages)
            self.broker._pending.close(request_id)
            future.cancel()
        for actor in reversed(list(self.actors.values())):
            await actor.stop()
        await self.broker.close()


@pytest.fixture(scope="module", params=TARGETS)
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("fuzz"), request.param)
    yield c
    c.run(c.stop())
    c.runner.close()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_every_fuzzed_message_is_settled(cluster: Cluster, data: st.DataObject) -> None:
    handled = tuple(cls.__name__ for cls in cluster.actor.handlers)
    cluster.send(data.draw(fuzzed(focus=handled)))


def soon(seconds: float = 5.0) -> float:
    return time.time() + seconds


async def settle(cluster: Cluster) -> StatusReport:
    """End what the fuzz left open (as a controller taking over would), wait for every handler."""
    for address in TARGETS[1:]:
        report = await cluster.client.request(address, Status(checkpoint_id="after-status", deadline=soon()))
        assert isinstance(report, StatusReport)
        if report.checkpoint_id and report.phase != "idle":
            abort = Abort(checkpoint_id=report.checkpoint_id, deadline=soon(), reason="the fuzz is over")
            assert isinstance(await cluster.client.request(address, abort), Ok)
    queues = [cluster.hub.queues[(RUN, cluster.target, lane)] for lane in Lane]
    await until(lambda: not any(q.messages for q in queues) and cluster.actor.in_flight == 0, timeout=60)
    report = await cluster.client.request(cluster.target, Status(checkpoint_id="after", deadline=soon()))
    assert isinstance(report, StatusReport)
    return report


def test_the_actor_survived_and_accounted_for_everything(cluster: Cluster) -> None:
    async def check() -> None:
        report = await settle(cluster)
        assert f"{report.role}/{report.replica}" == cluster.target
        counts = report.counts
        refused = sum(counts.get(k, 0) for k in REFUSALS)
        letters = await cluster.broker.read_dead_letters(limit=100_000)
        assert cluster.sent == EXAMPLES
        # Every refusal was dead-lettered by the fuzzed actor, with its code, and nothing else was.
        assert {letter.origin for letter in letters} <= {cluster.target}
        assert len(letters) == refused
        assert counts.get("refused:internal", 0) == 0, [
            (letter.code, letter.detail) for letter in letters if letter.code == "internal"
        ]
        answered = 0
        for letter in letters:
            assert f"refused:{letter.code}" in REFUSALS
            request_id = letter.envelope.headers.get(REQUEST_ID_HEADER)
            if request_id is None:
                continue
            reply = cluster.waiting[request_id]
            assert reply.done(), f"no reply to a refused message ({letter.code}: {letter.detail})"
            error = codec.decode(reply.result().body, reply.result().content_type)
            assert isinstance(error, Error) and error.code.value == letter.code
            assert error.detail == letter.detail
            answered += 1
        # The fuzz exercised both sides: plenty refused (and answered), plenty handled.
        assert refused > cluster.sent * 0.2 and answered > refused * 0.3
        assert cluster.sent - refused > cluster.sent * 0.05
        await real_work(cluster)

    cluster.run(check())


async def real_work(cluster: Cluster) -> None:
    """The fuzzed actor still does its job, then takes part in a whole workload with snapshots."""
    client, target = cluster.client, cluster.target
    if target != "controller/0":
        cid = "after-fuzz-1"
        prepared = await client.request(target, Prepare(checkpoint_id=cid, deadline=soon(20)))
        assert isinstance(prepared, Prepared), prepared
        committed = await client.request(
            target, Commit(checkpoint_id=cid, deadline=soon(20), location=f"tmp_{cid}")
        )
        assert isinstance(committed, Committed), committed
        assert await client.request(target, Resume(checkpoint_id=cid, deadline=soon())) == Ok(
            detail="resumed"
        )
        persisted = await client.request(
            target, Persist(checkpoint_id=cid, deadline=soon(20), location=f"tmp_{cid}")
        )
        assert isinstance(persisted, Persisted) and persisted.files, persisted
    if target == "policy/0":
        call = Generate(rollout_id="after_p", attempt=0, call_index=0, token_ids=(1, 2, 3), max_tokens=16)
        generated = await client.request(target, call, correlation_id="after_p:0")
        assert isinstance(generated, Generated) and generated.token_ids
    elif target == "resources/0":
        call = ToolCall(
            rollout_id="after_g0",
            attempt=0,
            call_index=0,
            env="counter",
            tool="increment",
            arguments={"by": 2},
        )
        result = await client.request(target, call, correlation_id="after_g0:tool:0")
        assert isinstance(result, ToolResult) and result.ok, result
    elif target == "tq/0":
        row = StagingRow(capture_key="after_g0", turn=0, token_ids=(5, 6))
        await client.send(target, Rows(rows=(row,)), correlation_id="after_g0:0")
        sealed = await client.request(
            target,
            SealRows(
                rollout_id="after_g0",
                attempt=0,
                capture_key="after_g0",
                reward=1.0,
                staging_keys=("after_g0:0",),
            ),
            correlation_id="seal:after_g0",
        )
        assert isinstance(sealed, Ok), sealed
        fetched = await client.request(
            target, FetchRows(rollout_ids=("after_g0",)), correlation_id="fetch:after"
        )
        assert isinstance(fetched, CanonicalRows) and fetched.rows[0].turns[0].token_ids == (5, 6)
    elif target == "agent/0":
        run = Run(rollout_id="after_g0", attempt=0, group_id="after", env="counter", prompt="count", epoch=1)
        agent = cluster.actor
        # The receipt as it goes out: the controller, which never dispatched this attempt, acks it at
        # once, so it is in the agent's ``unacked`` only for a moment (polling there once missed it).
        receipts: list[object] = []
        send_receipt = agent._send_receipt

        async def recorded(receipt: Any) -> None:
            receipts.append(receipt)
            await send_receipt(receipt)

        agent._send_receipt = recorded
        await client.send(target, run, correlation_id="after_g0")
        await until(lambda: bool(receipts), timeout=30)
        receipt = receipts[0]  # (the resender may send it again before the ack)
        assert type(receipt).__name__ == "Completed" and receipt.rollout_id == "after_g0", receipt
    # The whole cluster, the fuzzed actor included, runs a workload with snapshots to the end.
    controller: Controller = cluster.actors["controller/0"]
    summary = await controller.run_workload(
        cluster.config, load_tasks(cluster.config.tasks), snapshot_root=cluster.root / "snapshots"
    )
    assert summary.rollouts_sealed == summary.rollouts_expected == 4 and summary.rollouts_failed == 0
    assert summary.snapshots_published >= 1, msgspec.structs.asdict(summary)
