"""The controller's side of ``Forget`` (docs/memory.md#controller-and-trainer): rollouts are forgotten only
once sealed (or given up) AND acknowledged, in batches of at most ``FORGET_BATCH`` refs, flushed when
full, on a timer and at the end of a run; a participant that is down blocks no other and gets its refs
again later (bounded); and at the end of a run the controller's own per-rollout records are empty."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.launch.workload import run_workload
from parkway.actors.roles.controller import Controller, forget
from parkway.actors.roles.controller.forget import FORGET_BATCH, Forgetting
from parkway.actors.roles.controller.outbox import AckOutbox
from parkway.actors.run.config import from_dict
from parkway.actors.run.tasks import load_tasks
from parkway.actors.runtime.history import History
from parkway.brokers.base import RequestTimeout
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.errors import ErrorCode
from parkway.protocol.ids import is_valid_checkpoint_id
from parkway.protocol.messages import AttemptRef, Error, Forget, Message, Ok

from tests.support.signed import SECRET
from tests.support.waiting import until

PARTICIPANTS = ["tq/0", "policy/0", "resources/0", "agent/0"]


class FakeClient:
    """Answers every Forget with Ok, except from addresses that are ``down`` (a timeout) or
    ``refusing`` (a typed error that no retry fixes). Records every request that was answered."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.refusing: set[str] = set()
        self.got: dict[str, list[Forget]] = {a: [] for a in PARTICIPANTS}
        self.tried: Counter[str] = Counter()

    async def request(self, address: str, message: Message) -> Message:
        assert isinstance(message, Forget)
        self.tried[address] += 1
        if address in self.down:
            raise RequestTimeout(f"{address} is down")
        if address in self.refusing:
            return Error(code=ErrorCode.UNAUTHORIZED, detail="no", retryable=False)
        self.got[address].append(message)
        return Ok()


def refs(n: int, prefix: str = "r") -> tuple[AttemptRef, ...]:
    return tuple(AttemptRef(rollout_id=f"{prefix}{i}_g0", attempt=0) for i in range(n))


def forgotten(client: FakeClient, address: str) -> list[tuple[str, int]]:
    return [(r.rollout_id, r.attempt) for m in client.got[address] for r in m.attempts]


def forgetting(client: FakeClient) -> tuple[Forgetting, Counter[str]]:
    counts: Counter[str] = Counter()
    return Forgetting(client, counts, lambda: list(PARTICIPANTS)), counts  # type: ignore[arg-type]  # the fake has request only


async def test_nothing_is_forgotten_before_the_ack_of_the_receipt_that_ended_the_rollout() -> None:
    client = FakeClient()
    f, counts = forgetting(client)
    ended = (AttemptRef(rollout_id="a_g0", attempt=0), AttemptRef(rollout_id="a_g0", attempt=1))
    f.ended(ended, ack_of=("a_g0", 1))
    await f.flush()
    assert all(not client.got[a] for a in PARTICIPANTS) and f.sizes()["forget_after_ack"] == 1
    f.acked([("b_g0", 0)])  # another receipt's Ack changes nothing
    await f.flush()
    assert all(not client.got[a] for a in PARTICIPANTS)
    f.acked([("a_g0", 1)])
    await f.flush()
    for address in PARTICIPANTS:
        assert forgotten(client, address) == [("a_g0", 0), ("a_g0", 1)], address
    assert f.sizes() == {"forget_after_ack": 0, "forget_batch": 0, "forget_backlog": 0}
    assert counts["forget_sent"] == 2 * len(PARTICIPANTS) and counts["forget_batches"] == len(PARTICIPANTS)


async def test_a_rollout_given_up_without_a_receipt_is_forgettable_at_once() -> None:
    client = FakeClient()
    f, _ = forgetting(client)
    f.ended(refs(1), ack_of=None)
    await f.flush()
    assert forgotten(client, "tq/0") == [("r0_g0", 0)]


async def test_batches_hold_at_most_512_refs_and_each_has_a_fresh_valid_id() -> None:
    client = FakeClient()
    f, _ = forgetting(client)
    many = refs(2 * FORGET_BATCH + 76)
    for i, ref in enumerate(many):
        f.ended((ref,), ack_of=(ref.rollout_id, 0))
        f.acked([(ref.rollout_id, 0)])
        if i == FORGET_BATCH - 1:
            assert f._full.is_set()  # a full batch wakes the flusher at once
    await f.flush()
    for address in PARTICIPANTS:
        messages = client.got[address]
        assert [len(m.attempts) for m in messages] == [FORGET_BATCH, FORGET_BATCH, 76]
        assert forgotten(client, address) == [(r.rollout_id, r.attempt) for r in many]
        ids = [m.checkpoint_id for m in messages]
        assert len(set(ids)) == 3 and all(is_valid_checkpoint_id(i) for i in ids), ids


async def test_the_flusher_sends_a_batch_that_is_not_full_on_its_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(forget, "FORGET_FLUSH_S", 0.05)
    client = FakeClient()
    f, _ = forgetting(client)
    task = asyncio.get_running_loop().create_task(f.run())
    try:
        f.ended(refs(3), ack_of=None)
        await until(lambda: all(len(forgotten(client, a)) == 3 for a in PARTICIPANTS), timeout=10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert f.sizes()["forget_batch"] == 0


async def test_a_participant_that_is_down_blocks_no_other_and_gets_its_refs_when_back() -> None:
    client = FakeClient()
    client.down.add("resources/0")
    f, counts = forgetting(client)
    f.ended(refs(5), ack_of=None)
    await f.flush(tries=2)
    assert client.tried["resources/0"] == 2  # bounded retries, then given up for this flush
    assert counts["forget_failed"] == 1
    for address in ("tq/0", "policy/0", "agent/0"):
        assert len(forgotten(client, address)) == 5, address
    assert forgotten(client, "resources/0") == [] and f.sizes()["forget_backlog"] == 5
    client.down.clear()
    f.ended(refs(2, prefix="s"), ack_of=None)
    await f.flush()
    # Back: the backlog first, then the new batch; the others get only the new refs.
    assert forgotten(client, "resources/0") == [(f"r{i}_g0", 0) for i in range(5)] + [
        ("s0_g0", 0),
        ("s1_g0", 0),
    ]
    assert len(forgotten(client, "tq/0")) == 7
    assert f.sizes()["forget_backlog"] == 0


async def test_the_backlog_of_a_participant_that_stays_down_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(forget, "FORGET_BACKLOG", 10)
    client = FakeClient()
    client.down.add("agent/0")
    f, counts = forgetting(client)
    for round_ in range(3):
        f.ended(refs(8, prefix=f"x{round_}-"), ack_of=None)
        await f.flush(tries=1)
    assert f.sizes()["forget_backlog"] == 10
    assert counts["forget_dropped"] == 3 * 8 - 10
    assert len(forgotten(client, "tq/0")) == 24


async def test_a_participant_that_refuses_is_not_sent_the_refs_again() -> None:
    client = FakeClient()
    client.refusing.add("policy/0")
    f, counts = forgetting(client)
    f.ended(refs(4), ack_of=None)
    await f.flush()
    assert client.tried["policy/0"] == 1 and counts["forget_refused"] == 1
    assert f.sizes()["forget_backlog"] == 0


class HeldAckClient:
    """Sends Acks, each held until ``release`` is set: a flush caught in the middle of its send."""

    def __init__(self) -> None:
        self.sending, self.release = asyncio.Event(), asyncio.Event()
        self.sent: list[Message] = []

    async def send(self, address: str, message: Message, **_: Any) -> None:
        self.sending.set()
        await self.release.wait()
        self.sent.append(message)


async def test_the_runs_last_ack_flush_waits_for_the_timers_flush_in_flight() -> None:
    # The run's end flushes the outbox, then sends its last Forget. If the timer's flush had already
    # taken the last receipts and was still sending their Ack, the run's flush found nothing and
    # returned: those receipts reached Forgetting after the last Forget, and were never forgotten.
    client = HeldAckClient()
    outbox = AckOutbox(client, Counter(), History(None, "controller"))  # type: ignore[arg-type]
    f, counts = forgetting(FakeClient())
    outbox.on_acked = f.acked
    key = ("r0_g0", 2)
    outbox.route(key, 1)
    f.ended(refs(3), ack_of=key)
    outbox.acknowledge(key)
    timers = asyncio.get_running_loop().create_task(outbox.flush())
    await client.sending.wait()  # the timer's flush holds the Ack, not yet sent
    runs_end = asyncio.get_running_loop().create_task(outbox.flush())
    await asyncio.sleep(0)
    assert not runs_end.done()  # it waits for the flush in flight
    client.release.set()
    await runs_end
    assert timers.done() and len(client.sent) == 1
    await f.flush()  # the run's last Forget carries the rollout
    assert counts["forget_sent"] == 3 * len(PARTICIPANTS)


RUN: dict[str, Any] = {
    "run": "forgets",
    "seed": 5,
    "policy": {"host": "inline", "per_token_delay_s": 0.0},
    "tasks": {"builtin": "letters", "limit": 120},
    "rollout": {"group_size": 2, "max_turns": 2, "max_in_flight": 8, "max_attempts": 3},
    "topology": {"agents": 2, "resources": 2},
    "faults": {"failure_rate": 0.2},
}


async def test_a_run_forgets_every_attempt_everywhere_and_ends_with_its_records_empty(tmp_path: Path) -> None:
    config = from_dict(RUN)
    samples: list[dict[str, int]] = []
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        controller = Controller(broker, secret=SECRET)

        async def sample() -> None:
            while True:
                samples.append(controller.structure_sizes())
                await asyncio.sleep(0.01)

        sampler = asyncio.get_running_loop().create_task(sample())
        try:
            summary = await run_workload(
                broker,
                SECRET,
                config,
                load_tasks(config.tasks),
                embedded=True,
                state_root=tmp_path,
                snapshots=False,
                controller=controller,
            )
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        sizes = controller.structure_sizes()
    served = 120 * 2
    assert summary.rollouts_sealed + summary.rollouts_failed == served
    assert summary.attempts_failed > 0  # retries happened: more attempts than rollouts to forget
    counts = controller.counts
    participants = 1 + 1 + 2 + 2  # tq, policy, resources, agents
    # Every attempt dispatched, forgotten once at each participant (sibling retries: no duplicates).
    assert counts["forget_sent"] == summary.attempts_dispatched * participants, dict(counts)
    assert counts["forget_failed"] == 0
    for name in ("ack_routes", "dispatch_clocks", "forget_after_ack", "forget_batch", "forget_backlog"):
        assert sizes[name] == 0, (name, sizes)
    assert sizes["ledger_groups"] == 0 and sizes["trained_groups"] == 0, sizes
    # Bounded by what is in flight (8 rollouts, 3 attempts each at most, and as many again that
    # ended within the last flush or tick), never by what was served (240 rollouts, more attempts).
    bound = 3 * 8 * 3
    assert bound < served / 3
    running = [s for s in samples if "ack_routes" in s]
    assert len(running) > 3, "too few samples taken while the run was going"
    for name in ("ack_routes", "dispatch_clocks"):
        assert max(s[name] for s in running) <= bound, (name, max(s[name] for s in running))
