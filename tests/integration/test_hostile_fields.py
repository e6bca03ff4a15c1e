"""Issue 21, holes 1 and 2, over the real RabbitMQ against a live ``parkway actor`` process.

1. A signed message with a field nested far deeper than the interpreter's recursion limit is refused
   ``invalid_message``, never ``internal``.
2. A ``Prepare`` whose deadline is infinite, NaN, absurd (1e300) or beyond the actor's horizon
   (``PARKWAY_MAX_DEADLINE_S``) is refused ``invalid_message`` and holds nothing; one that is accepted
   lets its lease lapse on its own, so the policy's admission opens again and it generates.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from parkway.actors.launch.processes import Process
from parkway.actors.runtime.client import Client
from parkway.brokers.rabbitmq import RabbitBroker
from parkway.protocol import codec
from parkway.protocol.messages import Error, Generate, Generated, Prepare, Prepared

from tests.support.fuzz import deep_document, signed_bytes
from tests.support.processes import SECRET, start_actor_process, status_of, wait_ready
from tests.support.rabbit import AMQP_URL, delete_run, rabbitmq_reachable

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

HORIZON_S = 3.0  # the policy process's PARKWAY_MAX_DEADLINE_S (its Status requests ask 1 s ahead)


class Policy:
    def __init__(self, root: Path) -> None:
        assert rabbitmq_reachable(), f"RabbitMQ is not reachable at {AMQP_URL}"
        self.run = f"hf{uuid.uuid4().hex[:8]}"
        self.process: Process = start_actor_process(
            "policy", 0, AMQP_URL, self.run, root, PARKWAY_MAX_DEADLINE_S=str(HORIZON_S)
        )
        self.tq = start_actor_process("tq", 0, AMQP_URL, self.run, root)  # where generations stage rows
        self.runner = asyncio.Runner()
        self.broker = RabbitBroker(AMQP_URL, self.run)
        self.runner.run(self.broker.start())
        self.client = Client(self.broker, secret=SECRET.encode(), sender="operator/0")
        for process in (self.process, self.tq):
            self.runner.run(wait_ready(self.client, process, timeout=60))

    def send(self, body: bytes, content_type: str, correlation_id: str) -> object:
        """Send signed bytes to policy/0 and return its decoded reply."""

        async def go() -> object:
            envelope = signed_bytes(
                self.client, body, correlation_id=correlation_id, content_type=content_type, to="policy/0"
            )
            reply = await self.broker.request("policy/0", envelope, deadline=time.time() + 20)
            return self.client.open_reply(reply, requested="policy/0")

        return self.runner.run(go())

    def close(self) -> None:
        self.process.stop()
        self.tq.stop()
        self.runner.run(self.broker.close())
        self.runner.run(delete_run(AMQP_URL, self.run, ["policy/0", "tq/0"]))
        self.runner.close()


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Policy]:
    p = Policy(tmp_path_factory.mktemp("hostile-fields"))
    yield p
    p.close()


@pytest.mark.parametrize("content_type", [codec.JSON, codec.MSGPACK])
@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_a_deeply_nested_field_is_invalid_message_not_internal(
    policy: Policy, content_type: str, depth: int
) -> None:
    body = deep_document(
        {"type": "Probe", "v": 1, "checkpoint_id": "ck-deep", "deadline": 1e9}, depth, content_type
    )
    reply = policy.send(body, content_type, "ck-deep")
    assert isinstance(reply, Error) and reply.code.value == "invalid_message", reply
    assert "nested too deeply" in reply.detail


def _prepare(deadline: object) -> dict[str, object]:
    return {"type": "Prepare", "v": 1, "checkpoint_id": "ck-forever", "deadline": deadline}


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (msgspec.msgpack.encode(_prepare(math.inf)), codec.MSGPACK),
        (msgspec.msgpack.encode(_prepare(math.nan)), codec.MSGPACK),
        (msgspec.msgpack.encode(_prepare(-math.inf)), codec.MSGPACK),
        (msgspec.msgpack.encode(_prepare(1e300)), codec.MSGPACK),
        (b'{"type": "Prepare", "v": 1, "checkpoint_id": "ck-forever", "deadline": 1e300}', codec.JSON),
        (b'{"type": "Prepare", "v": 1, "checkpoint_id": "ck-forever", "deadline": 1e400}', codec.JSON),
        (b'{"type": "Prepare", "v": 1, "checkpoint_id": "ck-forever", "deadline": Infinity}', codec.JSON),
        (b'{"type": "Prepare", "v": 1, "checkpoint_id": "ck-forever", "deadline": NaN}', codec.JSON),
    ],
    ids=[
        "msgpack-inf",
        "msgpack-nan",
        "msgpack-neg-inf",
        "msgpack-1e300",
        "json-1e300",
        "json-1e400",
        "json-Infinity",
        "json-NaN",
    ],
)
def test_an_absurd_deadline_is_invalid_message_and_holds_nothing(
    policy: Policy, body: bytes, content_type: str
) -> None:
    reply = policy.send(body, content_type, "ck-forever")
    assert isinstance(reply, Error) and reply.code.value == "invalid_message", reply
    report = policy.runner.run(status_of(policy.client, "policy/0", timeout=1.0))
    assert (report.phase, report.checkpoint_id) == ("idle", None)


def test_a_deadline_beyond_the_horizon_is_invalid_message(policy: Policy) -> None:
    far = time.time() + 10 * 24 * 3600.0  # ten days ahead: finite, plausible, and far beyond the horizon
    reply = policy.send(msgspec.msgpack.encode(_prepare(far)), codec.MSGPACK, "ck-forever")
    assert isinstance(reply, Error) and reply.code.value == "invalid_message", reply
    assert "PARKWAY_MAX_DEADLINE_S" in reply.detail
    report = policy.runner.run(status_of(policy.client, "policy/0", timeout=1.0))
    assert (report.phase, report.checkpoint_id) == ("idle", None)


def test_an_accepted_prepare_lapses_on_its_own_and_generation_goes_on(policy: Policy) -> None:
    client = policy.client

    async def check() -> None:
        prepare = Prepare(checkpoint_id="ck-lapses", deadline=time.time() + HORIZON_S * 0.8)
        assert isinstance(await client.request("policy/0", prepare), Prepared)
        assert (await status_of(client, "policy/0", timeout=1.0)).phase == "prepared"
        # Nobody sends Resume or Abort: the lease runs out and the policy resumes by itself.
        async with asyncio.timeout(60):
            while (report := await status_of(client, "policy/0", timeout=1.0)).phase != "idle":  # noqa: ASYNC110 - another process
                await asyncio.sleep(0.1)
        assert report.checkpoint_id is None and report.counts.get("Prepare") == 1
        generate = Generate(
            rollout_id="after_lapse", attempt=0, call_index=0, token_ids=(1, 2, 3), max_tokens=4
        )
        generated = await client.request("policy/0", generate, correlation_id="after_lapse:0")
        assert isinstance(generated, Generated) and generated.token_ids

    policy.runner.run(check())
    assert policy.process.alive()
