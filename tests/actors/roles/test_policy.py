"""The policy actor on the in-memory broker, with its engine inline.

Generate -> Generated plus a staging row at a fake ``tq/0``; and the checkpoint behaviour: a checkpoint
holds nothing at the policy (a call that arrives while it is prepared is served, one generating at
Prepare is answered as soon as it finishes, and Prepare never waits for a generation); a weight update
holds new calls at its own gate. Interleavings are forced with events (the policy's
``wait_for_weights`` and a gated ``pool.generate``), never slept into. A checkpoint here is Prepare,
Commit, Resume, then Persist, as the controller runs it.
"""

from __future__ import annotations

import asyncio
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
from parkway.protocol.errors import ErrorCode
from parkway.protocol.messages import (
    AttemptRef,
    Commit,
    Committed,
    Error,
    Generate,
    Generated,
    LoadWeights,
    Message,
    Ok,
    Persist,
    Persisted,
    Prepare,
    Prepared,
    Restore,
    Restored,
    Resume,
    Retire,
    Rows,
    StagingRow,
    WeightsLoaded,
)

from tests.support.signed import SECRET

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


class Observed(Policy):
    """A policy that tells the test whenever a call waits at its weights gate."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.at_gate: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    async def wait_for_weights(self, request_id: str) -> None:
        if self.loading_weights:
            self.at_gate.put_nowait((request_id, "weights"))
        await super().wait_for_weights(request_id)


class Cluster:
    def __init__(self, broker: MemoryBroker, policy: Observed) -> None:
        self.broker = broker
        self.policy = policy
        self.agent = Client(broker, secret=SECRET, sender="agent/0")
        self.controller = Client(broker, secret=SECRET, sender="controller/0")  # control needs its key
        self.rows: asyncio.Queue[tuple[str, Message]] = asyncio.Queue()

    async def on_row(self, delivery: Delivery) -> None:
        self.rows.put_nowait(
            (delivery.envelope.correlation_id, self.agent.open(delivery.envelope, at="tq/0"))
        )
        await delivery.ack()

    async def generate(self, call_index: int = 0, *, rollout_id: str = "g_g0", attempt: int = 0) -> Message:
        call = Generate(
            rollout_id=rollout_id,
            attempt=attempt,
            call_index=call_index,
            token_ids=PROMPT,
            seed=5,
            max_tokens=256,
        )
        request_id = f"{rollout_id if attempt == 0 else f'{rollout_id}-a{attempt}'}:{call_index}"
        return await self.agent.request("policy/0", call, correlation_id=request_id, timeout=20)

    async def control(self, command: Message) -> Message:
        return await self.controller.request("policy/0", command)  # type: ignore[arg-type]

    async def commit_and_resume(self, checkpoint_id: str) -> dict[str, object]:
        """Finish the checkpoint (Commit, Resume, then Persist after the window); return the policy's
        snapshot record."""
        location = f"tmp_{checkpoint_id}"
        committed = await self.control(
            Commit(checkpoint_id=checkpoint_id, deadline=soon(), location=location)
        )
        assert isinstance(committed, Committed)
        assert await self.control(Resume(checkpoint_id=checkpoint_id, deadline=soon())) == Ok(
            detail="resumed"
        )
        persisted = await self.control(
            Persist(checkpoint_id=checkpoint_id, deadline=soon(), location=location)
        )
        assert isinstance(persisted, Persisted) and self.policy.snapshot_root is not None
        written = self.policy.participant_dir(location) / persisted.files[0].path
        [record] = msgspec.msgpack.decode(written.read_bytes())
        return record


@pytest.fixture
async def make_cluster(tmp_path: Path):
    hub = MemoryHub()
    made: list[tuple[MemoryBroker, Observed]] = []

    async def make(per_token_delay_s: float = 0.0) -> Cluster:
        broker = MemoryBroker(hub, RUN)
        await broker.start()
        policy = Observed(
            broker,
            secret=SECRET,
            engine=EngineSpec(kwargs={"per_token_delay_s": per_token_delay_s}),
            engine_host="inline",
            snapshot_root=tmp_path,
            lease_grace_s=30.0,
        )
        cluster = Cluster(broker, policy)
        await broker.declare("tq/0")
        await broker.consume("tq/0", cluster.on_row)
        await policy.start()
        made.append((broker, policy))
        return cluster

    yield make
    for broker, policy in made:
        if policy.pool.started:
            await policy.stop()
        await broker.close()


def soon() -> float:
    return time.time() + 10


def restore_here() -> Restore:
    """A Restore of this replica's own records (``install_snapshot`` is given their directory)."""
    return Restore(checkpoint_id="rs-1", deadline=soon(), location="snapshot_1")


def expected_reply() -> tuple[tuple[int, ...], tuple[float, ...]]:
    request = GenerationRequest(request_id="x", token_ids=PROMPT, seed=5, max_tokens=256)
    tokens, logprobs = DeterministicEngine().reply_tokens(request)
    return tuple(tokens), tuple(logprobs)


async def test_generate_replies_and_stages_a_row(make_cluster) -> None:
    cluster = await make_cluster()
    cluster.policy.policy_version = 3
    reply = await cluster.generate(call_index=2, attempt=1)
    tokens, logprobs = expected_reply()
    assert reply == Generated(
        rollout_id="g_g0",
        attempt=1,
        call_index=2,
        token_ids=tokens,
        logprobs=logprobs,
        finish_reason="stop",
        policy_version=3,
    )
    assert chat.parse_reply(chat.decode(tokens)).tool_calls  # a real tool call, in the chat format
    correlation_id, rows = await asyncio.wait_for(cluster.rows.get(), 5)
    assert correlation_id == "g_g0-a1:2"
    assert rows == Rows(
        rows=(
            StagingRow(
                capture_key="g_g0-a1",
                turn=2,
                token_ids=tokens,
                logprobs=logprobs,
                policy_version=3,
                prompt_token_ids=PROMPT,  # what the call was prompted with: the trainer's context
            ),
        )
    )
    counts = cluster.policy.counts
    assert counts["model_calls"] == 1 and counts["tokens_generated"] == len(tokens)
    assert counts["replies_held"] == 0


async def test_its_status_counts_the_tokens_accrued_by_its_inline_engine(make_cluster) -> None:
    cluster = await make_cluster()
    assert cluster.policy.status_fields()["counts"]["tokens_accrued"] == 0
    await cluster.generate(call_index=0)
    counts = cluster.policy.status_fields()["counts"]
    assert counts["tokens_accrued"] == counts["tokens_generated"] == len(expected_reply()[0])


async def test_a_call_arriving_while_prepared_is_served(make_cluster) -> None:
    # A checkpoint holds nothing at the policy: a rollout its agent holds keeps the reply itself.
    cluster = await make_cluster()
    assert await cluster.control(Prepare(checkpoint_id="ck-1", deadline=soon())) == Prepared(
        checkpoint_id="ck-1", parked=0
    )
    reply = await asyncio.wait_for(cluster.generate(call_index=0), 5)
    assert isinstance(reply, Generated) and reply.token_ids == expected_reply()[0]
    assert (await asyncio.wait_for(cluster.rows.get(), 5))[0] == "g_g0:0"
    record = await cluster.commit_and_resume("ck-1")
    assert record["generating"] == [] and "held" not in record
    assert cluster.policy.at_gate.empty()


async def test_a_call_generating_at_prepare_is_answered_as_it_finishes(make_cluster) -> None:
    cluster = await make_cluster(per_token_delay_s=0.002)
    policy = cluster.policy
    generating, may_generate = asyncio.Event(), asyncio.Event()
    engine_generate = policy.pool.generate

    async def gated_generate(request: GenerationRequest):
        generating.set()
        await may_generate.wait()
        return await engine_generate(request)

    policy.pool.generate = gated_generate  # type: ignore[method-assign]
    call = asyncio.ensure_future(cluster.generate(call_index=1))
    await asyncio.wait_for(generating.wait(), 5)
    # Prepare does not wait for the generation: it answers while the call is still generating.
    prepared = await cluster.control(Prepare(checkpoint_id="ck-2", deadline=soon()))
    assert prepared == Prepared(checkpoint_id="ck-2", parked=1)
    policy.policy_version = 2
    committed = asyncio.ensure_future(cluster.commit_and_resume("ck-2"))
    may_generate.set()  # it finishes while the checkpoint is open: staged, then answered at once
    reply = await asyncio.wait_for(call, 5)
    assert isinstance(reply, Generated) and reply.call_index == 1 and reply.finish_reason == "stop"
    correlation_id, rows = await asyncio.wait_for(cluster.rows.get(), 5)
    assert correlation_id == "g_g0:1" and isinstance(rows, Rows)
    assert rows.rows[0].token_ids == expected_reply()[0]
    record = await committed
    assert record["policy_version"] == 2 and cluster.rows.empty()  # one row per call


async def test_retiring_an_attempt_aborts_its_generation_without_a_row(make_cluster) -> None:
    cluster = await make_cluster(per_token_delay_s=0.01)
    generating = asyncio.Event()
    engine_generate = cluster.policy.pool.generate

    async def observed_generate(request: GenerationRequest):
        generating.set()
        return await engine_generate(request)

    cluster.policy.pool.generate = observed_generate  # type: ignore[method-assign]
    call = asyncio.ensure_future(cluster.generate(call_index=0, rollout_id="g_g7"))
    await asyncio.wait_for(generating.wait(), 5)
    retired = await cluster.control(
        Retire(checkpoint_id="rt-1", deadline=soon(), attempts=(AttemptRef(rollout_id="g_g7", attempt=0),))
    )
    assert retired == Ok(detail="retired 1")
    reply = await asyncio.wait_for(call, 5)
    assert isinstance(reply, Error) and reply.code is ErrorCode.STALE_ATTEMPT
    assert cluster.rows.empty() and cluster.policy.pool.in_flight() == 0
    late = await cluster.generate(call_index=1, rollout_id="g_g7")
    assert isinstance(late, Error) and late.code is ErrorCode.STALE_ATTEMPT


async def test_a_restore_drops_the_calls_in_flight_without_fencing_their_attempts(make_cluster) -> None:
    # Found by parkway chaos: after a cluster crash, the new policy process picked up a dead attempt's
    # queued call; the restore fenced that (rollout, attempt), which the restored ledger then gave to the
    # rollout's next attempt, so every call of it was refused and the rollout was given up.
    cluster = await make_cluster(per_token_delay_s=0.01)
    await cluster.control(Prepare(checkpoint_id="ck-r", deadline=soon()))
    await cluster.commit_and_resume("ck-r")
    generating = asyncio.Event()
    engine_generate = cluster.policy.pool.generate

    async def observed_generate(request: GenerationRequest):
        generating.set()
        return await engine_generate(request)

    cluster.policy.pool.generate = observed_generate  # type: ignore[method-assign]
    call = asyncio.ensure_future(cluster.generate(call_index=2, rollout_id="g_g7", attempt=1))
    await asyncio.wait_for(generating.wait(), 5)
    restored = await cluster.policy.install_snapshot(
        cluster.policy.participant_dir("tmp_ck-r"), restore_here()
    )
    assert restored == ()
    reply = await asyncio.wait_for(call, 5)
    assert isinstance(reply, Error) and reply.code is ErrorCode.UNAVAILABLE  # not cached
    assert "restored while this call waited" in reply.detail
    assert cluster.rows.empty() and cluster.policy.pool.in_flight() == 0  # nothing of it staged
    again = await cluster.generate(call_index=2, rollout_id="g_g7", attempt=1)  # the restored attempt 1
    assert isinstance(again, Generated) and again.call_index == 2
    assert ("g_g7", 1) not in cluster.policy.retired


async def test_a_restore_forgets_the_replies_of_the_timeline_that_died(make_cluster) -> None:
    # Found by parkway chaos: a live policy answered the restored ledger's attempt 2 (a number the dead
    # controller had used too) from its reply cache, so no staging row reached the restored TQ, every
    # snapshot failed validation, and each restore ran into the same cached reply again.
    cluster = await make_cluster()
    await cluster.control(Prepare(checkpoint_id="ck-f", deadline=soon()))
    await cluster.commit_and_resume("ck-f")
    first = await cluster.generate(call_index=0, rollout_id="g_g8", attempt=2)  # the dead timeline's
    assert isinstance(first, Generated)
    staged, _ = await asyncio.wait_for(cluster.rows.get(), 5)
    written = cluster.policy.participant_dir("tmp_ck-f")
    tmp = next(d for d in written.parents if d.name == "tmp_ck-f")
    tmp.rename(tmp.with_name("snapshot_1"))  # published, as the controller would
    restore = Restore(checkpoint_id="rs-f", deadline=soon(), location="snapshot_1")
    assert isinstance(await cluster.control(restore), Restored)
    assert await cluster.control(Resume(checkpoint_id="rs-f", deadline=soon())) == Ok(detail="resumed")
    again = await cluster.generate(call_index=0, rollout_id="g_g8", attempt=2)  # the restored ledger's
    assert isinstance(again, Generated)
    restaged, _ = await asyncio.wait_for(cluster.rows.get(), 5)  # generated and staged again
    assert restaged == staged and cluster.policy.counts["model_calls"] == 2


async def test_stop_leaves_calls_at_the_weights_gate_for_redelivery(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster()
    policy = cluster.policy
    loading, may_finish = asyncio.Event(), asyncio.Event()

    async def slow_load(directory: str) -> int:
        loading.set()
        await may_finish.wait()  # the update runs until the policy is stopping
        return 0

    policy.pool.load_weights = slow_load  # type: ignore[method-assign]
    update = asyncio.ensure_future(cluster.control(load_weights(tmp_path, 1)))
    await asyncio.wait_for(loading.wait(), 5)
    call = asyncio.ensure_future(cluster.generate(call_index=4))
    assert (await asyncio.wait_for(policy.at_gate.get(), 5))[1] == "weights"
    stopping = asyncio.ensure_future(policy.stop())
    await asyncio.sleep(0)  # stop() has begun: the call at the gate gives up, left for redelivery
    may_finish.set()
    await asyncio.wait_for(stopping, 5)  # does not hang on the waiting call
    await asyncio.gather(update, return_exceptions=True)
    assert not call.done() and policy.counts["model_calls"] == 0
    # The Generate is back in the policy's queue; a new policy process answers it.
    successor = Observed(cluster.broker, secret=SECRET, engine_host="inline")
    await successor.start()
    try:
        reply = await asyncio.wait_for(call, 5)
        assert isinstance(reply, Generated) and reply.call_index == 4
    finally:
        await successor.stop()


def load_weights(directory: Path | str, version: int, checkpoint_id: str = "w-1") -> LoadWeights:
    return LoadWeights(
        checkpoint_id=checkpoint_id, deadline=soon(), directory=str(directory), policy_version=version
    )


async def test_a_weight_update_waits_for_calls_generating_and_holds_new_ones_until_loaded(
    make_cluster, tmp_path: Path
) -> None:
    cluster = await make_cluster()
    policy = cluster.policy
    weights = tmp_path / "step-1"
    weights.mkdir()
    generating, may_generate = asyncio.Event(), asyncio.Event()
    loading, may_load = asyncio.Event(), asyncio.Event()
    engine_generate, engine_load = policy.pool.generate, policy.pool.load_weights

    async def gated_generate(request: GenerationRequest):
        if request.request_id == "g_g0:0":
            generating.set()
            await may_generate.wait()
        return await engine_generate(request)

    async def gated_load(directory: str) -> int:
        loading.set()
        await may_load.wait()
        return await engine_load(directory)

    policy.pool.generate = gated_generate  # type: ignore[method-assign]
    policy.pool.load_weights = gated_load  # type: ignore[method-assign]
    old_call = asyncio.ensure_future(cluster.generate(call_index=0))
    await asyncio.wait_for(generating.wait(), 5)
    update = asyncio.ensure_future(cluster.control(load_weights(weights, 1)))
    new_call = asyncio.ensure_future(cluster.generate(call_index=1))
    # The new call waits at the weights gate; the update waits for the old call, not the other way.
    assert await asyncio.wait_for(policy.at_gate.get(), 5) == ("g_g0:1", "weights")
    assert not loading.is_set() and not update.done()
    may_generate.set()
    old = await asyncio.wait_for(old_call, 5)
    assert isinstance(old, Generated) and old.policy_version == 0  # finished on the old weights
    await asyncio.wait_for(loading.wait(), 5)
    assert not new_call.done() and policy.generating == 0
    may_load.set()
    loaded = await asyncio.wait_for(update, 5)
    assert isinstance(loaded, WeightsLoaded)
    assert (loaded.policy_version, loaded.directory, loaded.replicas) == (1, str(weights), 1)
    new = await asyncio.wait_for(new_call, 5)
    assert isinstance(new, Generated) and new.policy_version == 1
    assert policy.counts["weight_updates"] == 1 and policy.weights_dir == str(weights)
    assert policy.pool._engine.weights == str(weights)  # the engine itself was told


async def test_bad_weight_updates_get_typed_errors_and_change_nothing(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster()
    policy = cluster.policy
    first = tmp_path / "step-2"
    first.mkdir()
    missing = await cluster.control(load_weights(tmp_path / "nowhere", 1, "w-missing"))
    assert isinstance(missing, Error) and missing.code is ErrorCode.INVALID_MESSAGE
    assert "does not exist" in missing.detail and policy.policy_version == 0
    # A name the file system refuses to look up (a component over 255 bytes: ENAMETOOLONG) is the
    # same typed refusal, not an internal error (the fuzz test found this one).
    too_long = await cluster.control(load_weights(tmp_path / ("é" * 300), 1, "w-too-long"))
    assert isinstance(too_long, Error) and too_long.code is ErrorCode.INVALID_MESSAGE
    assert "cannot be read: File name too long" in too_long.detail and policy.policy_version == 0
    assert isinstance(await cluster.control(load_weights(first, 2, "w-2")), WeightsLoaded)
    again = await cluster.control(load_weights(first, 2, "w-2-again"))  # the same version: a no-op
    assert again == WeightsLoaded(policy_version=2, directory=str(first), replicas=0, seconds=0.0)
    older = await cluster.control(load_weights(first, 1, "w-older"))
    assert isinstance(older, Error) and older.code is ErrorCode.INVALID_MESSAGE
    other = tmp_path / "other"
    other.mkdir()
    clash = await cluster.control(load_weights(other, 2, "w-clash"))  # same version, other weights
    assert isinstance(clash, Error) and clash.code is ErrorCode.INVALID_MESSAGE
    assert (policy.policy_version, policy.weights_dir, policy.counts["weight_updates"]) == (2, str(first), 1)
    reply = await cluster.generate(call_index=0)  # still serving
    assert isinstance(reply, Generated) and reply.policy_version == 2


async def test_a_restored_policy_reloads_the_weights_its_rollouts_used(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster()
    weights = tmp_path / "step-3"
    weights.mkdir()
    assert isinstance(await cluster.control(load_weights(weights, 3)), WeightsLoaded)
    await cluster.control(Prepare(checkpoint_id="ck-w", deadline=soon()))
    record = await cluster.commit_and_resume("ck-w")
    assert (record["policy_version"], record["weights_dir"]) == (3, str(weights))
    fresh = await make_cluster()  # a new policy process: start-up weights, version 0
    assert fresh.policy.weights_dir is None
    location = fresh.policy.participant_dir("tmp_ck-w")
    restored = await fresh.policy.install_snapshot(location, restore_here())
    assert restored == () and fresh.policy.policy_version == 3
    assert fresh.policy.weights_dir == str(weights) and fresh.policy.pool._engine.weights == str(weights)
