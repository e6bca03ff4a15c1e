"""Hostile messages over the real RabbitMQ at every role, each actor in its own process.

A cluster of processes (controller, agent, resources, policy, tq) takes a few hundred fuzzed
deliveries per role on its queue (``tests/support/fuzz.py``: every category, from random bytes to deep
nesting, absurd numbers, bad signatures, replays, odd reply addresses and bursts). Every delivery must
be accounted for: refused with a typed code (dead-lettered at the edge, with an ``Error`` reply of the
same code where it had a reply address), or answered; none may be ``internal``; every process must be
the same one at the end. Then each does real work of its kind, the fuzzed controller process stops
cleanly, and a fresh controller runs a whole workload with snapshots over the fuzzed participants: it
seals every rollout, with the transcripts of a run nobody fuzzed. An oversized body (over the 16 MiB
limit, under RabbitMQ's own) is refused the same way. ``bench/fuzz_actors.py`` is the longer run.
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
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parkway.actors.launch.roles import ROLES
from parkway.brokers.base import Envelope
from parkway.protocol import codec
from parkway.protocol.errors import ProtocolError
from parkway.protocol.messages import (
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
    Probe,
    ProbeResult,
    Resume,
    Rows,
    Run,
    SealRows,
    StagingRow,
    StatusReport,
    ToolCall,
    ToolResult,
)

from tests.support.fuzz import CATEGORIES, fuzzed
from tests.support.fuzz_cluster import ANSWERED, TARGETS, FuzzCluster, table
from tests.support.processes import actor_env, status_of
from tests.support.rabbit import AMQP_URL
from tests.support.storage_run import json_lines

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

EXAMPLES = int(os.environ.get("PARKWAY_FUZZ_PROCESS_EXAMPLES", "150"))  # per role
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzCluster]:
    c = FuzzCluster(tmp_path_factory.mktemp("fuzz-processes"), CONFIG)
    yield c
    c.close()


@pytest.mark.parametrize("address", TARGETS)
@settings(
    max_examples=EXAMPLES,
    derandomize=True,  # the same deliveries every run: a failure is reproduced by running it again
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_publish_fuzzed_messages(cluster: FuzzCluster, address: str, data: st.DataObject) -> None:
    cluster.send(address, data.draw(fuzzed(focus=handled_types(address))))


@pytest.mark.parametrize("address", TARGETS)
@pytest.mark.parametrize("category", CATEGORIES)
@settings(
    max_examples=1, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
@given(data=st.data())
def test_publish_one_delivery_of_each_category(
    cluster: FuzzCluster, address: str, category: str, data: st.DataObject
) -> None:
    """The weighted draws above may miss a rare category at a role: each is sent once for certain."""
    cluster.send(address, data.draw(fuzzed(focus=handled_types(address), category=category)))


def soon(seconds: float = 10.0) -> float:
    return time.time() + seconds


def test_every_delivery_was_refused_with_a_typed_code_or_answered_and_every_process_survived(
    cluster: FuzzCluster,
) -> None:
    async def check() -> None:
        await cluster.settle()
        outcomes, others = await cluster.outcomes()
        print(table(outcomes))  # (pytest -s shows it)
        fates = Counter(o.fate for o in outcomes)
        assert fates["refused:internal"] == 0, [
            (o.sent.category, o.dead_letter.detail if o.dead_letter else o.reply)
            for o in outcomes
            if o.fate == "refused:internal"
        ]
        assert [(x.origin, x.code) for x in others if x.code == "internal"] == []
        assert {x.origin for x in others} <= set(TARGETS)
        # Every category was tried at every role, and both sides were exercised.
        assert {(o.sent.address, o.sent.category) for o in outcomes} >= {(a, "typed") for a in TARGETS}
        assert {o.sent.category for o in outcomes} == set(CATEGORIES)
        refused = sum(n for fate, n in fates.items() if fate.startswith("refused:"))
        assert refused > len(outcomes) * 0.2 and fates[ANSWERED] > len(outcomes) * 0.1, fates
        for o in outcomes:
            if o.dead_letter is not None and o.sent.future is not None:
                # An edge refusal with a reply address got an Error with the dead letter's code and detail.
                assert isinstance(o.reply, Error), (o.sent.category, o.dead_letter.detail, o.reply)
                assert (o.reply.code.value, o.reply.detail) == (o.dead_letter.code, o.dead_letter.detail)
            if o.sent.category == "burst":  # every question of a burst answered, each with a status
                assert isinstance(o.reply, StatusReport), o.reply
            if o.sent.category in ("unsigned", "wrong_secret", "other_run"):
                assert o.fate == "refused:unauthorized", (o.sent.category, o.fate)
            assert not isinstance(o.reply, ProtocolError), o.reply  # every reply decodes
        for address, process in cluster.processes.items():
            assert process.alive(), process.log_text()[-3000:]
            assert (await status_of(cluster.client, address)).pid == cluster.pids[address]

    cluster.runner.run(check())


@functools.cache
def handled_types(address: str) -> tuple[str, ...]:
    """The message types the role at ``address`` handles (read off an actor that is never started)."""
    from parkway.brokers.memory import MemoryBroker, MemoryHub

    actor = ROLES[address.split("/")[0]](MemoryBroker(MemoryHub(), "types"), secret=b"x")
    return tuple(cls.__name__ for cls in actor.handlers)


def test_an_oversized_body_is_refused_by_a_process_and_dead_lettered(cluster: FuzzCluster) -> None:
    async def check() -> None:
        limit = codec.MAX_BODY_BYTES
        body = (
            b'{"type": "Probe", "v": 1, "checkpoint_id": "big", "deadline": 2e9, "note": "'
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


def test_then_every_process_does_real_work(cluster: FuzzCluster) -> None:
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
            assert isinstance(committed, Committed)
            assert await client.request(address, Resume(checkpoint_id=cid, deadline=soon())) == Ok(
                detail="resumed"
            )
            persisted = await client.request(
                address, Persist(checkpoint_id=cid, deadline=soon(30), location=f"tmp_{cid}")
            )
            assert isinstance(persisted, Persisted) and persisted.files
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
    participants = {address: cluster.processes[address] for address in TARGETS[1:]}
    before = {address: len(p.log_text()) for address, p in participants.items()}
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
    # The fuzzed participants did work of this run (valid commands are among the fuzz), so the new
    # controller starts a session afresh under session-tagged ids rather than being answered from
    # their caches; its transcripts are a fresh session's, not comparable with an unfuzzed run's.
    assert summary["session"] == "afresh", summary
    # A reply the session's actors got again from a cache answers a resend of the session's own (a
    # request retried after a timeout on a loaded machine, a redelivery), never an id used before the
    # session. A fuzzer's delivery can still be answered again while the session runs (seen once in
    # CI: a redelivery, or one unacknowledged, which the ready count settle reads does not show);
    # such a reply goes to the fuzzer, for one of its own ids.
    # The summary counted replays of both (the logs go on after it).
    earlier: set[str] = set(cluster.correlation_ids)
    replays: list[dict[str, Any]] = []
    for address, process in participants.items():
        text = process.log_text()
        for event in json_lines(text[: before[address]]):
            earlier.update(str(v) for k, v in event.items() if k in ("correlation_id", "checkpoint_id"))
        replays += [e for e in json_lines(text[before[address] :]) if e.get("event") == "reply_replayed"]
    assert summary["replayed_from_cache"] <= len(replays), (summary, replays)
    outsiders = ("fuzz/0", "operator/0", "stranger/0")
    for replay in replays:
        if replay["sender"] in outsiders:
            assert replay["correlation_id"] in cluster.correlation_ids, replay
        else:
            assert replay["correlation_id"] not in earlier, replay
    assert summary["turns_generated"] > 0 and summary["generations_total"] >= summary["turns_kept"] > 0
    for address in TARGETS[1:]:
        assert cluster.processes[address].alive()
