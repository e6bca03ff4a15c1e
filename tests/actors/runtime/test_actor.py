"""The actor runtime on the in-memory broker: replies, bad input, the reply cache, logs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import structlog
from parkway.actors.roles.controller.controller import Controller
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.runtime.actor import Actor
from parkway.actors.runtime.client import Client
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol import codec
from parkway.protocol.errors import ErrorCode
from parkway.protocol.messages import (
    CanonicalRows,
    Error,
    FetchRows,
    Message,
    Ok,
    Probe,
    ProbeResult,
    ReleaseRows,
    Rows,
    Run,
    SealRows,
    StagingRow,
    Status,
    StatusReport,
)

from tests.support.signed import SECRET, raw_request, signed_raw
from tests.support.waiting import until

RUN = "unit"


@pytest.fixture
async def hub() -> MemoryHub:
    return MemoryHub()


@pytest.fixture
async def broker(hub: MemoryHub):
    async with MemoryBroker(hub, RUN) as b:
        yield b


@pytest.fixture
async def client(broker: MemoryBroker) -> Client:
    return Client(broker, secret=SECRET, sender="test/0")


@pytest.fixture
async def tq(broker: MemoryBroker, tmp_path: Path):
    actor = TransferQueue(broker, secret=SECRET, replica=0, state_dir=tmp_path / "tq")
    await actor.start()
    yield actor
    await actor.stop()


def probe(cid: str = "p-1", **kwargs: object) -> Probe:
    return Probe(checkpoint_id=cid, deadline=time.time() + 10, **kwargs)  # type: ignore[arg-type]


async def test_status_reports_the_actor(tq: Actor, client: Client) -> None:
    reply = await client.request("tq/0", Status(checkpoint_id="s-1", deadline=time.time() + 5))
    assert isinstance(reply, StatusReport)
    assert (reply.role, reply.replica, reply.run, reply.phase) == ("tq", 0, RUN, "idle")


async def test_wrong_secret_is_unauthorized_and_dead_lettered(tq: Actor, broker: MemoryBroker) -> None:
    intruder = Client(broker, secret=b"guess", sender="test/0")
    # The intruder cannot verify the reply either (it is signed with the run's secret), so read it raw.
    envelope = intruder.envelope(probe(), correlation_id="p-1", to="tq/0")
    raw = await broker.request("tq/0", envelope, deadline=time.time() + 5)
    reply = codec.decode(raw.body, raw.content_type)
    assert isinstance(reply, Error) and reply.code is ErrorCode.UNAUTHORIZED
    [letter] = await broker.read_dead_letters()
    assert letter.code == "unauthorized" and letter.origin == "tq/0"
    assert tq.counts["refused:unauthorized"] == 1 and tq.counts["Probe"] == 0


async def test_a_message_signed_for_another_run_is_unauthorized(tq: Actor, hub: MemoryHub) -> None:
    # Same secret, same queue name, other run: the run is part of what is signed.
    async with MemoryBroker(hub, "other") as other:
        foreign = Client(other, secret=SECRET, sender="test/0").envelope(
            probe(), correlation_id="p-1", to="tq/0"
        )
    async with MemoryBroker(hub, RUN) as same_run:
        raw = await same_run.request("tq/0", foreign, deadline=time.time() + 5)
    assert codec.decode(raw.body).code is ErrorCode.UNAUTHORIZED  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"\x93\x01\x02", ErrorCode.INVALID_MESSAGE),
        (b'{"type": "Nope", "v": 1}', ErrorCode.INVALID_MESSAGE),
        (b'{"type": "Status", "v": 9, "checkpoint_id": "s", "deadline": 1}', ErrorCode.UNSUPPORTED_VERSION),
        (b'{"type": "Status", "v": 1, "checkpoint_id": "other", "deadline": 1}', ErrorCode.INVALID_MESSAGE),
    ],
)
async def test_bad_input_gets_a_typed_reply_and_a_dead_letter(
    tq: Actor, client: Client, broker: MemoryBroker, body: bytes, code: ErrorCode
) -> None:
    content_type = codec.JSON if body.startswith(b"{") else codec.MSGPACK
    reply = await raw_request(
        client, "tq/0", signed_raw(RUN, body, correlation_id="bad-1", to="tq/0", content_type=content_type)
    )
    assert isinstance(reply, Error) and reply.code is code and not reply.retryable
    [letter] = await broker.read_dead_letters()
    assert (letter.code, letter.envelope.body) == (code.value, body)
    assert isinstance(
        await client.request("tq/0", Status(checkpoint_id="s-2", deadline=time.time() + 5)), StatusReport
    )


async def test_a_message_for_another_role_is_refused(tq: Actor, client: Client, broker: MemoryBroker) -> None:
    run = Run(rollout_id="g_g0", attempt=0, group_id="g", env="counter", prompt="p")
    reply = await client.request("tq/0", run, correlation_id="r-1")
    assert isinstance(reply, Error) and "tq/0 does not handle Run" in reply.detail
    assert len(await broker.read_dead_letters()) == 1


async def test_a_retried_command_gets_the_cached_reply_and_runs_once(tq: Actor, client: Client) -> None:
    first = await client.request("tq/0", probe("p-7", note="a"))
    second = await client.request("tq/0", probe("p-7", note="a"))
    assert isinstance(first, ProbeResult) and first.executions == 1
    assert second == first
    assert tq.counts["Probe"] == 1 and tq.counts["replayed"] == 1


async def test_a_handler_that_raised_runs_again_when_its_message_comes_again(
    tq: Actor, client: Client, broker: MemoryBroker
) -> None:
    # CI's chaos schedule: the controller's Completed handler raised (its seal request met a broker
    # restart), and every resend of that receipt was then answered from the reply cache, never run:
    # the rollout waited two minutes for the stall watchdog. A failure is not an answer to remember.
    handle = tq.handlers[Probe]
    calls = {"n": 0}

    async def fails_once(message: Probe) -> Message:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("the broker went away under this handler")
        return await handle(message)

    tq.handlers[Probe] = fails_once
    first = await client.request("tq/0", probe("p-11"))
    second = await client.request("tq/0", probe("p-11"))
    assert isinstance(first, Error) and first.code is ErrorCode.INTERNAL
    assert isinstance(second, ProbeResult) and calls["n"] == 2 and tq.counts.get("replayed", 0) == 0
    third = await client.request("tq/0", probe("p-11"))  # a success is remembered as before
    assert third == second and calls["n"] == 2 and tq.counts["replayed"] == 1
    assert len(await broker.read_dead_letters()) == 1  # the failed delivery, once


async def test_a_read_of_canonical_rows_is_answered_fresh_not_cached(tq: Actor, broker: MemoryBroker) -> None:
    # The trainer's FetchRows is read-only: a second read under the same id sees what TQ holds now
    # (here: nothing, the rows were released), and no read's reply takes room in the reply cache.
    trainer = Client(broker, secret=SECRET, sender="trainer/0")
    controller = Client(broker, secret=SECRET, sender="controller/0")
    staged = StagingRow(capture_key="g_g0", turn=0, token_ids=(1, 2), logprobs=(-0.5, -0.5))
    await tq.on_rows(Rows(rows=(staged,)))
    sealed = await controller.request(
        "tq/0",
        SealRows(rollout_id="g_g0", attempt=0, capture_key="g_g0", reward=1.0),
        correlation_id="seal:g_g0",
    )
    assert isinstance(sealed, Ok)
    cached = len(tq.replies)
    first = await trainer.request("tq/0", FetchRows(rollout_ids=("g_g0",)), correlation_id="fetch-1")
    assert isinstance(first, CanonicalRows) and [r.rollout_id for r in first.rows] == ["g_g0"]
    released = await controller.request(
        "tq/0", ReleaseRows(rollout_ids=("g_g0",)), correlation_id="release-1"
    )
    assert isinstance(released, Ok), released
    again = await trainer.request("tq/0", FetchRows(rollout_ids=("g_g0",)), correlation_id="fetch-1")
    assert isinstance(again, CanonicalRows) and again.rows == () and again.missing == ("g_g0",)
    # A release is idempotent: not kept either; the same one again runs again and drops nothing more.
    assert len(tq.replies) == cached
    repeated = await controller.request(
        "tq/0", ReleaseRows(rollout_ids=("g_g0",)), correlation_id="release-1"
    )
    assert isinstance(repeated, Ok) and repeated.detail.startswith("released 0 ")
    assert tq.counts["ReleaseRows"] == 2 and tq.counts.get("replayed", 0) == 0 and len(tq.replies) == cached


async def test_concurrent_duplicates_wait_for_the_first(tq: Actor, client: Client) -> None:
    replies = await asyncio.gather(*(client.request("tq/0", probe("p-8", work_s=0.05)) for _ in range(3)))
    assert len({r for r in replies}) == 1
    assert tq.counts["Probe"] == 1 and tq.counts["replayed"] == 2


async def test_the_same_id_from_another_sender_is_another_command(tq: Actor, broker: MemoryBroker) -> None:
    a = Client(broker, secret=SECRET, sender="controller/0")
    b = Client(broker, secret=SECRET, sender="cli/1")
    assert (await a.request("tq/0", probe("p-9"))).executions == 1  # type: ignore[attr-defined]
    assert (await b.request("tq/0", probe("p-9"))).executions == 2  # type: ignore[attr-defined]


async def test_the_reply_journal_survives_a_new_process(
    broker: MemoryBroker, client: Client, tmp_path: Path
) -> None:
    state = tmp_path / "ctl"
    first = Controller(broker, secret=SECRET, state_dir=state)
    await first.start()
    reply = await client.request("controller/0", probe("p-10"))
    await first.stop()
    second = Controller(broker, secret=SECRET, state_dir=state)  # a restart with the same state dir
    await second.start()
    again = await client.request("controller/0", probe("p-10"))
    await second.stop()
    assert again == reply
    assert second.counts["replayed"] == 1 and second.counts["Probe"] == 0
    assert (state / "probe.log").read_text().count("p-10") == 1


class Exploding(Actor):
    role = "exploding"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.handlers[Run] = self.on_run

    async def on_run(self, message: Run) -> Message:
        raise RuntimeError(f"bug while running {message.rollout_id}")


async def test_a_handler_bug_is_an_internal_error_not_a_dead_actor(
    broker: MemoryBroker, client: Client
) -> None:
    actor = Exploding(broker, secret=SECRET)
    await actor.start()
    reply = await client.request(
        "exploding/0",
        Run(rollout_id="g_g1", attempt=0, group_id="g", env="counter", prompt="p"),
        correlation_id="r",
    )
    assert (
        isinstance(reply, Error)
        and reply.code is ErrorCode.INTERNAL
        and "bug while running g_g1" in reply.detail
    )
    [letter] = await broker.read_dead_letters()
    assert letter.code == "internal"
    assert isinstance(await client.request("exploding/0", probe()), ProbeResult)
    await actor.stop()


async def test_log_context_is_bound_once_per_message(tq: Actor, client: Client) -> None:
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        await client.request(
            "tq/0",
            Run(rollout_id="g_g2", attempt=3, group_id="g", env="counter", prompt="p"),
            correlation_id="r-2",
        )
    [refusal] = [e for e in logs if e["event"] == "message_refused"]
    assert (refusal["actor"], refusal["run"], refusal["code"]) == ("tq/0", RUN, "invalid_message")
    assert refusal["correlation_id"] == "r-2" and refusal["sender"] == "test/0"


async def test_stop_finishes_the_handler_in_progress_and_leaves_the_rest(
    broker: MemoryBroker, client: Client
) -> None:
    actor = Controller(broker, secret=SECRET)
    actor.prefetch = 1  # type: ignore[misc]
    actor.control_prefetch = 1  # the probes are control commands: they come on the control lane
    await actor.start()
    slow = asyncio.ensure_future(client.request("controller/0", probe("p-slow", work_s=0.2)))
    queued = asyncio.ensure_future(client.request("controller/0", probe("p-next")))
    await until(lambda: actor.in_flight == 1)
    await actor.stop()
    assert isinstance(await slow, ProbeResult)  # finished and answered
    assert not queued.done()  # not started: left on the queue
    successor = Controller(broker, secret=SECRET)
    await successor.start()
    assert isinstance(await queued, ProbeResult)  # redelivered to the next process
    await successor.stop()


async def test_answered_requests_are_remembered_no_longer_than_their_replies(
    tq: Actor, client: Client
) -> None:
    # Only a request whose reply is cached is ever looked up as answered; this memory once kept 10,000
    # pairs whatever the cache held, and grew TQ for thousands of rollouts after its cache was full.
    tq.replies.capacity = 8
    for n in range(20):
        assert isinstance(await client.request("tq/0", probe(f"p-{n}")), ProbeResult)
    assert len(tq.replies) == 8 and len(tq._answered_requests) == 8
    again = await client.request("tq/0", probe("p-19"))  # the newest is still answered from the cache
    assert isinstance(again, ProbeResult) and tq.counts["Probe"] == 20 and tq.counts["replayed"] == 1


async def test_queries_and_replies_the_cache_dropped_are_not_remembered_as_answered(
    tq: Actor, client: Client
) -> None:
    # A query's reply is never cached, so its request is never looked up: an actor polled for its
    # Status every few seconds once filled this memory towards its bound over a long run.
    for n in range(5):
        assert isinstance(
            await client.request("tq/0", Status(checkpoint_id=f"s-{n}", deadline=time.time() + 5)),
            StatusReport,
        )
    assert len(tq._answered_requests) == 0 and len(tq.replies) == 0
    # A cache held under its capacity by its byte bound: no more requests remembered than replies kept.
    tq.replies.max_memory_bytes = 1
    for n in range(6):
        assert isinstance(await client.request("tq/0", probe(f"p-{n}")), ProbeResult)
    assert len(tq.replies) == 1 and list(tq._answered_requests) == [next(reversed(tq._answered_requests))]
    assert len(tq._answered_requests) == 1
