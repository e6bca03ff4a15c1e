"""Fuzz a cluster of live ``parkway actor`` processes over the real RabbitMQ, and account for every delivery.

Each role runs in its own process. ``send`` publishes one drawn delivery (``fuzz.fuzzed``) to an
actor's queue, tagged with a fuzz id header so its fate can be read back: its dead letter (an edge
refusal, with the code), its reply (an ``Error`` with a code, or an answer), or neither (a one-way
message, or one without a usable reply address). ``settle`` ends what the fuzz left open and waits
until every queue is empty; ``outcomes`` then gives each delivery's fate, and ``table`` sums them per
category. Used by ``tests/integration/test_fuzz_process.py`` and ``bench/fuzz_actors.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from parkway.actors.runtime.client import Client
from parkway.brokers.base import REQUEST_ID_HEADER, DeadLetter, Envelope
from parkway.brokers.rabbitmq import RabbitBroker
from parkway.protocol import codec
from parkway.protocol.errors import ProtocolError
from parkway.protocol.messages import Abort, Error, Status, StatusReport
from parkway.protocol.signing import TO_HEADER

from tests.support.fuzz import CATEGORIES, Fuzzed, Signers, envelope_of
from tests.support.processes import SECRET, start_actor_process, status_of, wait_ready
from tests.support.rabbit import AMQP_URL, delete_run, rabbitmq_reachable

TARGETS = ("controller/0", "agent/0", "resources/0", "policy/0", "tq/0")
FUZZ_ID_HEADER = "x-fuzz-id"  # not signed: it only lets the fuzzer find each delivery's dead letter
ANSWERED, NO_REPLY = "answered", "no reply"


@dataclass
class Sent:
    address: str
    category: str
    request_id: str | None  # set when the delivery carries the fuzzer's own reply address
    future: asyncio.Future[Envelope] | None = None


@dataclass
class Outcome:
    sent: Sent
    fate: str  # "refused:<code>", ANSWERED or NO_REPLY
    dead_letter: DeadLetter | None = None
    reply: object | None = None  # the decoded reply, when one came


@dataclass
class FuzzCluster:
    root: Path
    config_text: str
    run: str = field(default_factory=lambda: f"fz{uuid.uuid4().hex[:8]}")

    def __post_init__(self) -> None:
        assert rabbitmq_reachable(), f"RabbitMQ is not reachable at {AMQP_URL}"
        self.config = self.root / "run.yaml"
        self.config.write_text(self.config_text)
        self.state = self.root / "state"
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
        self.signers = Signers.of(self.broker, SECRET.encode())
        for process in self.processes.values():
            self.runner.run(wait_ready(self.client, process, timeout=60))
        self.pids = {address: p.pid for address, p in self.processes.items()}
        self.sent: dict[str, Sent] = {}  # fuzz id -> what was sent
        self._last: dict[str, Envelope] = {}  # address -> the last signed delivery drawn for it (replays)
        self.correlation_ids: set[str] = set()  # of every delivery published (fuzzed or not)

    # -- sending -------------------------------------------------------------------------------
    def send(self, address: str, item: Fuzzed) -> None:
        self.runner.run(self._send(address, item))

    async def _send(self, address: str, item: Fuzzed) -> None:
        if item.replay and address in self._last:
            base = self._last[address]  # exactly the same signed message again (its routing is not signed)
        else:
            base = envelope_of(item, self.signers, address)
            self._last[address] = base
        for _ in range(item.copies):
            fuzz_id = f"{address}#{len(self.sent)}"
            envelope = replace(base, headers={**base.headers, FUZZ_ID_HEADER: fuzz_id})
            if item.copies > 1:  # a burst: each copy its own question, answered on its own
                envelope = self._restatus(envelope, f"{base.correlation_id}-{len(self.sent)}")
            sent = Sent(address, item.category, None)
            if item.reply_to is not None:
                envelope = replace(envelope, reply_to=item.reply_to)
            elif item.reply:
                sent.request_id = f"fz-{uuid.uuid4().hex}"
                sent.future = self.broker._pending.open(sent.request_id)
                envelope = replace(
                    envelope,
                    headers={**envelope.headers, REQUEST_ID_HEADER: sent.request_id},
                    reply_to=self.broker.reply_address,
                )
            self.sent[fuzz_id] = sent
            self.correlation_ids.add(envelope.correlation_id)
            await self.broker.publish(address, envelope)

    def _restatus(self, envelope: Envelope, checkpoint_id: str) -> Envelope:
        """A burst copy: a Status question under its own id, signed as the fuzzer's own."""
        status = Status(checkpoint_id=checkpoint_id, deadline=time.time() + 60)
        signed = self.signers.ok.envelope(
            status,
            correlation_id=checkpoint_id,
            to=envelope.headers[TO_HEADER],
            content_type=envelope.content_type or codec.MSGPACK,
        )
        return replace(signed, headers={**envelope.headers, **signed.headers})

    # -- accounting ----------------------------------------------------------------------------
    async def settle(self) -> dict[str, dict[str, int]]:
        """End what the fuzz left open (as a controller taking over would), wait until every queue
        is empty and nothing is in flight; each process's status counts."""
        channel = await self.broker._connection.channel()  # type: ignore[union-attr]
        counts: dict[str, dict[str, int]] = {}
        async with asyncio.timeout(180):
            for address in TARGETS:
                while True:
                    report = await status_of(self.client, address)
                    if report.checkpoint_id and report.phase != "idle":
                        abort = Abort(
                            checkpoint_id=report.checkpoint_id, deadline=time.time() + 10, reason="fuzz over"
                        )
                        await self.client.request(address, abort)
                        continue
                    queue = await channel.declare_queue(self.broker.queue_name(address), passive=True)
                    if queue.declaration_result.message_count == 0 and report.in_flight == 0:
                        break
                    await asyncio.sleep(0.1)
                counts[address] = report.counts
            # Replies travel on each actor's channel in order: one more answered Status per actor
            # means every reply it sent before has arrived.
            for address in TARGETS:
                assert isinstance(await status_of(self.client, address), StatusReport)
        await channel.close()
        return counts

    async def outcomes(self) -> tuple[list[Outcome], list[DeadLetter]]:
        """Each delivery's fate (call after ``settle``), and the dead letters no fuzzed delivery explains."""
        letters = await self.broker.read_dead_letters(limit=10_000_000)
        by_id: dict[str, DeadLetter] = {}
        others = []
        for letter in letters:
            fuzz_id = letter.envelope.headers.get(FUZZ_ID_HEADER)
            if fuzz_id in self.sent and fuzz_id not in by_id:
                by_id[fuzz_id] = letter
            else:
                others.append(letter)
        results = []
        for fuzz_id, sent in self.sent.items():
            letter = by_id.get(fuzz_id)
            reply: object | None = None
            if sent.future is not None and sent.future.done() and not sent.future.cancelled():
                envelope = sent.future.result()
                try:
                    reply = codec.decode(envelope.body, envelope.content_type)
                except ProtocolError as err:
                    reply = err  # an actor's reply it cannot decode: reported, never expected
            if letter is not None:
                fate = f"refused:{letter.code}"
            elif isinstance(reply, Error):
                fate = f"refused:{reply.code.value}"
            elif reply is not None:
                fate = ANSWERED
            else:
                fate = NO_REPLY
            results.append(Outcome(sent, fate, letter, reply))
        return results, others

    def close(self) -> None:
        for sent in self.sent.values():  # requests no reply answers (data messages)
            if sent.future is not None and sent.request_id is not None:
                self.broker._pending.close(sent.request_id)
                sent.future.cancel()
        for process in self.processes.values():
            process.stop()
        self.runner.run(self.broker.close())
        # The controller's process hosts the trainer (inline) and declares its queues too.
        self.runner.run(delete_run(AMQP_URL, self.run, [*TARGETS, "trainer/0"]))
        self.runner.close()


def table(outcomes: list[Outcome]) -> str:
    """A Markdown table: per category, deliveries sent, refused (by code), answered, no reply."""
    rows: dict[str, Counter[str]] = defaultdict(Counter)
    for outcome in outcomes:
        rows[outcome.sent.category][outcome.fate] += 1
    lines = [
        "| category | sent | refused (by code) | answered | no reply |",
        "|---|---:|---|---:|---:|",
    ]
    total: Counter[str] = Counter()
    for category in (*CATEGORIES, *sorted(set(rows) - set(CATEGORIES))):
        fates = rows.get(category)
        if not fates:
            continue
        total.update(fates)
        lines.append(_row(category, fates))
    lines.append(_row("**all**", total))
    return "\n".join(lines)


def _row(name: str, fates: Counter[str]) -> str:
    refused = sorted((k.split(":", 1)[1], n) for k, n in fates.items() if k.startswith("refused:"))
    codes = ", ".join(f"{code} {n}" for code, n in refused) or "-"
    return f"| {name} | {sum(fates.values())} | {codes} | {fates[ANSWERED]} | {fates[NO_REPLY]} |"
