"""Prefix recovery at the policy (docs/recovery.md#prefix), on the in-memory broker, engine inline.

A checkpoint taken while a call generates keeps the tokens it has brought out so far; a new policy
process that installs that snapshot with ``keep_prefixes`` continues the restored rollout's call from
them: the reply is the whole call (the same as an uninterrupted one, the engine being deterministic),
the engine brings out only the rest (its own record says so), and the staging row says which tokens
came from which attempt. Without ``keep_prefixes`` (a restore at ``turn``) the call is generated from
its first token and the cut's tokens are counted as regenerated; a call that differs from the one cut
is not continued (a fallback, counted).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
import pytest
from parkway.actors.engines.base import GenerationRequest
from parkway.actors.engines.deterministic import DeterministicEngine
from parkway.actors.engines.ray_host import EngineSpec
from parkway.actors.roles.policy import Policy
from parkway.actors.runtime.client import Client
from parkway.actors.sdk import chat
from parkway.brokers.base import Delivery
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import (
    Commit,
    Committed,
    EpisodeRef,
    Generate,
    Generated,
    Message,
    Ok,
    Persist,
    Persisted,
    Prepare,
    Restore,
    Resume,
    Rows,
    TokenSegment,
)

from tests.support.signed import SECRET
from tests.support.waiting import until

RUN = "unit"
TOOLS = [chat.ToolSpec("increment", (("by", "int"),)), chat.ToolSpec("get", (), mutates=False)]
PROMPT = tuple(
    chat.encode(
        chat.render(
            [
                chat.Message("system", chat.system_prompt("count", TOOLS, 3)),
                chat.Message("user", "Count to 12."),
            ]
        )
    )
)
FILLER = 60  # words: a reply of a few hundred tokens
DELAY = 0.002  # seconds per token: a call generates for about a second
MAX_TOKENS = 600


class Node:
    """One policy process (its broker, its engine record) and the clients that talk to it."""

    def __init__(self, broker: MemoryBroker, policy: Policy, record: Path) -> None:
        self.broker, self.policy, self.record = broker, policy, record
        self.agent = Client(broker, secret=SECRET, sender="agent/0")
        self.controller = Client(broker, secret=SECRET, sender="controller/0")
        self.rows: asyncio.Queue[Rows] = asyncio.Queue()

    async def on_row(self, delivery: Delivery) -> None:
        message = self.agent.open(delivery.envelope, at="tq/0")
        assert isinstance(message, Rows)
        self.rows.put_nowait(message)
        await delivery.ack()

    def call(self, attempt: int, *, prompt: tuple[int, ...] = PROMPT) -> Generate:
        return Generate(
            rollout_id="g_g0", attempt=attempt, call_index=1, token_ids=prompt, seed=5, max_tokens=MAX_TOKENS
        )

    async def generate(self, attempt: int, **kwargs: object) -> Message:
        request_id = "g_g0:1" if attempt == 0 else f"g_g0-a{attempt}:1"
        return await self.agent.request(
            "policy/0", self.call(attempt, **kwargs), correlation_id=request_id, timeout=30
        )  # type: ignore[arg-type]

    async def control(self, command: Message) -> Message:
        return await self.controller.request("policy/0", command)  # type: ignore[arg-type]

    def engine_lines(self) -> list[dict[str, object]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]


@pytest.fixture
async def make_node(tmp_path: Path):
    hub = MemoryHub()
    made: list[Node] = []

    async def make(name: str, *, keep_prefixes: bool = True) -> Node:
        broker = MemoryBroker(hub, f"{RUN}-{name}")
        await broker.start()
        record = tmp_path / f"engine-{name}.jsonl"
        policy = Policy(
            broker,
            secret=SECRET,
            engine=EngineSpec(
                kwargs={"per_token_delay_s": DELAY, "filler_words": FILLER, "record": str(record)}
            ),
            engine_host="inline",
            snapshot_root=tmp_path / "snapshots",
            lease_grace_s=30.0,
            keep_prefixes=keep_prefixes,
        )
        node = Node(broker, policy, record)
        await broker.declare("tq/0")
        await broker.consume("tq/0", node.on_row)
        await policy.start()
        made.append(node)
        return node

    yield make
    for node in made:
        if node.policy.pool.started:
            await node.policy.stop()
        await node.broker.close()


def soon() -> float:
    return time.time() + 10


def uninterrupted() -> tuple[tuple[int, ...], tuple[float, ...]]:
    request = GenerationRequest(request_id="x", token_ids=PROMPT, seed=5, max_tokens=MAX_TOKENS)
    tokens, logprobs = DeterministicEngine(filler_words=FILLER).reply_tokens(request)
    return tuple(tokens), tuple(logprobs)


async def checkpoint_mid_call(
    node: Node,
    checkpoint_id: str = "ck-p",
    *,
    attempt: int = 0,
    at_least: int = 40,
    published: str = "snapshot_1",
) -> tuple[Path, dict[str, object]]:
    """A checkpoint taken while ``attempt``'s call generates (``at_least`` tokens out); its directory,
    published as ``published``, and the policy's record in it."""
    call = asyncio.ensure_future(node.generate(attempt))
    request_id = "g_g0:1" if attempt == 0 else f"g_g0-a{attempt}:1"
    await until(lambda: len(node.policy.pool.known_progress().get(request_id, ((),))[0]) >= at_least)
    await node.control(Prepare(checkpoint_id=checkpoint_id, deadline=soon()))
    location = f"tmp_{checkpoint_id}"
    assert isinstance(
        await node.control(Commit(checkpoint_id=checkpoint_id, deadline=soon(), location=location)), Committed
    )
    assert await node.control(Resume(checkpoint_id=checkpoint_id, deadline=soon())) == Ok(detail="resumed")
    persisted = await node.control(Persist(checkpoint_id=checkpoint_id, deadline=soon(), location=location))
    assert isinstance(persisted, Persisted)
    directory = node.policy.participant_dir(location)
    [record] = msgspec.msgpack.decode((directory / persisted.files[0].path).read_bytes())
    assert not call.done()  # the snapshot did not stop the generation
    call.cancel()
    tmp = next(d for d in directory.parents if d.name == location)
    moved = tmp.rename(tmp.with_name(published))
    return moved / directory.relative_to(tmp), record


def restore(keep_prefixes: bool, *, attempt: int = 1, location: str = "snapshot_1") -> Restore:
    return Restore(
        checkpoint_id=f"rs-{attempt}",
        deadline=soon(),
        location=location,
        episodes=(EpisodeRef(rollout_id="g_g0", attempt=attempt, replica=0),),
        keep_prefixes=keep_prefixes,
    )


async def test_a_restored_call_continues_from_the_tokens_its_snapshot_kept(make_node) -> None:
    whole, logprobs = uninterrupted()
    dying = await make_node("dying")
    directory, record = await checkpoint_mid_call(dying)
    [kept] = record["prefixes"]
    cut = len(kept["token_ids"])
    assert 40 <= cut < len(whole) and tuple(kept["token_ids"]) == whole[:cut]
    assert kept["segments"] == [{"tokens": cut, "attempt": 0, "policy_version": 0, "checkpoint_id": "ck-p"}]

    fresh = await make_node("fresh")  # the cluster restarted: a new policy process
    await fresh.policy.install_snapshot(directory, restore(keep_prefixes=True))
    reply = await fresh.generate(1)  # the restored rollout's attempt 1 sends the call again
    assert isinstance(reply, Generated)
    assert reply.token_ids == whole and reply.logprobs == logprobs  # one model call, whole
    [line] = fresh.engine_lines()  # the engine's own account: only the tokens after the cut
    assert (line["kept"], line["generated"]) == (cut, len(whole) - cut)
    counts = fresh.policy.counts
    assert (counts["calls_continued"], counts["prefix_tokens_kept"], counts["prefix_fallbacks"]) == (
        1,
        cut,
        0,
    )
    assert counts["tokens_generated"] == len(whole) - cut
    [row] = (await asyncio.wait_for(fresh.rows.get(), 5)).rows
    assert row.token_ids == whole and row.segments == (
        TokenSegment(tokens=cut, attempt=0, policy_version=0, checkpoint_id="ck-p"),
        TokenSegment(tokens=len(whole) - cut, attempt=1, policy_version=0),
    )
    assert row.token_versions() == (0,) * len(whole)
    assert fresh.policy.structure_sizes()["kept_prefixes"] == 0  # used once, then let go


async def test_a_restore_that_does_not_keep_prefixes_generates_the_call_from_its_first_token(
    make_node,
) -> None:
    whole, _ = uninterrupted()
    directory, record = await checkpoint_mid_call(await make_node("dying"))
    cut = len(record["prefixes"][0]["token_ids"])
    fresh = await make_node("fresh", keep_prefixes=False)
    await fresh.policy.install_snapshot(directory, restore(keep_prefixes=False))  # a restore at turn
    reply = await fresh.generate(1)
    assert isinstance(reply, Generated) and reply.token_ids == whole
    [line] = fresh.engine_lines()
    assert (line["kept"], line["generated"]) == (0, len(whole))
    counts = fresh.policy.counts
    assert (counts["prefix_tokens_regenerated"], counts["prefix_tokens_kept"], counts["calls_continued"]) == (
        cut,
        0,
        0,
    )
    [row] = (await asyncio.wait_for(fresh.rows.get(), 5)).rows
    assert row.segments == ()


async def test_a_call_that_differs_from_the_one_cut_is_not_continued(make_node) -> None:
    directory, record = await checkpoint_mid_call(await make_node("dying"))
    cut = len(record["prefixes"][0]["token_ids"])
    fresh = await make_node("fresh")
    await fresh.policy.install_snapshot(directory, restore(keep_prefixes=True))
    other = (*PROMPT[:-1], PROMPT[-1] ^ 1)  # a transcript that diverged: another prompt
    reply = await fresh.generate(1, prompt=other)
    assert isinstance(reply, Generated)
    [line] = fresh.engine_lines()
    assert line["kept"] == 0 and line["generated"] == len(reply.token_ids)
    counts = fresh.policy.counts
    assert (
        counts["prefix_fallbacks"],
        counts["prefix_tokens_regenerated"],
        counts["prefix_tokens_kept"],
    ) == (1, cut, 0)


async def test_a_policy_that_does_not_keep_prefixes_cuts_none(make_node) -> None:
    node = await make_node("plain", keep_prefixes=False)
    _, record = await checkpoint_mid_call(node)
    assert record["prefixes"] == [] and record["generating"] == ["g_g0:1"]


async def test_a_continued_call_cut_again_keeps_its_whole_reply_so_far(make_node) -> None:
    whole, _ = uninterrupted()
    directory, record = await checkpoint_mid_call(await make_node("first"))
    first_cut = len(record["prefixes"][0]["token_ids"])
    second = await make_node("second")
    await second.policy.install_snapshot(directory, restore(keep_prefixes=True))
    # The continued call (attempt 1) is cut by the next snapshot, and that cluster dies too.
    directory, record = await checkpoint_mid_call(
        second, "ck-q", attempt=1, at_least=first_cut + 30, published="snapshot_2"
    )
    [kept] = record["prefixes"]
    second_cut = len(kept["token_ids"])
    assert tuple(kept["token_ids"]) == whole[:second_cut] and second_cut >= first_cut + 30
    assert kept["segments"] == [
        {"tokens": first_cut, "attempt": 0, "policy_version": 0, "checkpoint_id": "ck-p"},
        {"tokens": second_cut - first_cut, "attempt": 1, "policy_version": 0, "checkpoint_id": "ck-q"},
    ]
    third = await make_node("third")
    await third.policy.install_snapshot(
        directory, restore(keep_prefixes=True, attempt=2, location="snapshot_2")
    )
    reply = await third.generate(2)
    assert isinstance(reply, Generated) and reply.token_ids == whole
    [line] = third.engine_lines()
    assert (line["kept"], line["generated"]) == (second_cut, len(whole) - second_cut)
    [row] = (await asyncio.wait_for(third.rows.get(), 5)).rows
    assert [(s.tokens, s.attempt) for s in row.segments] == [
        (first_cut, 0),
        (second_cut - first_cut, 1),
        (len(whole) - second_cut, 2),
    ]
